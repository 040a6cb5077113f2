"""GPTQ (Frantar et al., 2022): choose integer codes column by column, pushing each column's rounding error
onto the columns not yet quantized through the inverse Hessian of the layer's inputs.

The algorithm only decides codes. Qparams (scale, zero point per group) come from the caller's grid, the
same function round-to-nearest would use, so the result is ordinary layout data:

- ``grid.qparams(w)``: (scale, zero_point) of a whole (N, K) weight, the oracle's shapes (N, ceil(K / g)).
- ``grid.group_qparams(w_cols)``: the same for the (N, <= g) columns of one group: (N, 1) each.
- ``grid.quantize_columns(w_cols, scale_cols, zero_cols)``: (codes, dequantized) of some columns, each with the
  qparams column given (the oracle's ``quantize_affine`` / ``dequantize_affine``).
- ``grid.group_size``: how many consecutive columns of K share one qparams column.

Group qparams are chosen when the sweep reaches a group's first column, from the weights as updated so far
(what the reference implementation does), unless ``static_groups``: all from the original weight, which is
what act-order needs (columns then arrive out of order, and a group must keep one scale).
"""
from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["HessianAccumulator", "gptq_codes", "QuantGrid"]


class QuantGrid(Protocol):
    group_size: int

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def group_qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def quantize_columns(self, w: torch.Tensor, scale: torch.Tensor,
                         zero_point: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


class HessianAccumulator:
    """H = 2/n sum x x^T over every token row x (K,) seen by a Linear; float32 running mean."""

    def __init__(self, in_features: int, device=None):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        n = x.shape[0]
        if n == 0:
            return
        total = self.rows + n
        self.h.mul_(self.rows / total)
        x = x * (2.0 / total) ** 0.5
        self.h.addmm_(x.t(), x)
        self.rows = total


def _inverse_hessian_factor(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of H^-1, H damped by ``damp`` x mean(diag H) (Cholesky needs it positive definite)."""
    h = h.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    try:
        lower = torch.linalg.cholesky(h)
        return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    except torch.linalg.LinAlgError:
        raise ValueError(f"GPTQ: the Hessian of {name}'s inputs is not positive definite even with damping {damp}; "
                         f"use more (or more varied) calibration data, or a larger damp") from None


def gptq_codes(weight: torch.Tensor, hessian: torch.Tensor, grid: QuantGrid, *, damp: float = 0.01,
               block: int = 128, act_order: bool = False, static_groups: bool = False,
               name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes (N, K), scale, zero_point) for ``weight`` (N, K) given the Hessian (K, K) of its inputs.

    damp: fraction of the mean Hessian diagonal added to it; block: columns per lazy batch update (the
    result does not depend on it, only the speed); act_order: quantize columns in order of decreasing
    Hessian diagonal (needs static groups, implied)."""
    w = weight.detach().float().clone()
    n, k = w.shape
    h = hessian.float().clone()
    dead = h.diagonal() == 0  # inputs that are always zero: their weights can't matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    static_groups = static_groups or act_order
    scale, zero = grid.qparams(w) if static_groups else (None, None)
    order = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(k)
    w, h = w[:, order], h[order][:, order]
    hinv = _inverse_hessian_factor(h, damp, name)
    codes = torch.empty(n, k, dtype=torch.int64)
    g = grid.group_size
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(order[i1 + i])
            grp = col // g
            if not static_groups and col % g == 0:
                # dynamic groups: this group's qparams from the weights as updated so far (columns in order);
                # the other groups' columns of that call are not theirs: only this group's are kept
                current = torch.cat([w[:, :i1], w1, w[:, i2:]], dim=1)[:, col:col + g]
                group_scale, group_zero = grid.group_qparams(current)
                if scale is None:
                    groups = -(-k // g)
                    scale = group_scale.new_empty(n, groups)
                    zero = None if group_zero is None else group_zero.new_empty(n, groups)
                scale[:, grp] = group_scale[:, 0]
                if zero is not None:
                    zero[:, grp] = group_zero[:, 0]
            q, deq = grid.quantize_columns(w1[:, i:i + 1], scale[:, grp:grp + 1],
                                           None if zero is None else zero[:, grp:grp + 1])
            codes[:, i1 + i] = q[:, 0].long()
            e = (w1[:, i] - deq[:, 0].float()) / hinv1[i, i]
            w1[:, i:].sub_(e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0))
            err1[:, i] = e
        w[:, i1:i2] = w1
        w[:, i2:].sub_(err1 @ hinv[i1:i2, i2:])
    inverse = torch.argsort(order)
    return codes[:, inverse], scale, zero
