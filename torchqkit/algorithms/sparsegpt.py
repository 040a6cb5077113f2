"""SparseGPT (Frantar & Alistarh, 2023) for N:M patterns: prune (and optionally quantize) a Linear's weight column
by column, pushing each column's error onto the columns not yet visited through the inverse Hessian of its inputs.

Note [SparseGPT N:M]
~~~~~~~~~~~~~~~~~~~~
The sweep is GPTQ's (gptq.py): the upper Cholesky factor U of H^-1 (H = 2/n sum x x^T, damped), columns in order, a
lazy batch of ``block`` columns updated at once. When the sweep reaches the first column of a block of M inputs, each
row keeps the N entries of that block with the largest OBS saliency w^2 / U[j, j]^2 (the weights as updated so far),
so the mask follows the compensation. Column j then becomes q = 0 where pruned and, where kept, w itself (no base) or
w rounded on the base config's grid; the error (w - q) / U[j, j] updates the later columns. With a grid, each group's
qparams are chosen when the sweep reaches the group (as GPTQ's dynamic groups do), from the group's current weights
with the entries its provisional mask (the same saliency, then) would prune replaced by kept values of their block
(Note [Sparse qparams], api/sparsify.py). One pass prunes and quantizes, as in the paper.
"""
from __future__ import annotations

import torch

from .gptq import QuantGrid, _inverse_hessian_factor
from .nm_masks import fill_pruned, nm_prune_mask

__all__ = ["SparseGPTResult", "sparsegpt"]


class SparseGPTResult:
    """What ``sparsegpt`` decided: ``mask`` (R, K) bool; ``weight`` (R, K) float32, the pruned and updated weight
    (without a grid); or ``codes`` (R, K) int64 and ``scale`` / ``zero_point`` (with one)."""

    def __init__(self, mask, weight=None, codes=None, scale=None, zero_point=None):
        self.mask, self.weight, self.codes, self.scale, self.zero_point = mask, weight, codes, scale, zero_point


def sparsegpt(weight: torch.Tensor, hessian: torch.Tensor, n: int, m: int, grid: QuantGrid | None = None, *,
              damp: float = 0.01, block: int = 128, name: str = "weight") -> SparseGPTResult:
    """Prune ``weight`` (R, K) to ``n``:``m`` given the Hessian (K, K) of its inputs, quantizing the kept entries on
    ``grid`` when given (Note [SparseGPT N:M]). ``block``: columns per lazy update, rounded up to a multiple of ``m``
    (the result doesn't depend on it, only the speed)."""
    w = weight.detach().float().clone()
    rows, k = w.shape
    h = hessian.float().clone()
    dead = h.diagonal() == 0  # inputs that are always zero: their weights can't matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    hinv = _inverse_hessian_factor(h, damp, name)
    block = -(-block // m) * m
    mask = torch.zeros(rows, k, dtype=torch.bool)
    state = _GridState(grid, rows, k) if grid is not None else None
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(rows, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % m == 0:
                d = hinv1.diagonal()[i:i + m]
                mask[:, col:col + m] = nm_prune_mask(w1[:, i:i + m].square() / d.square(), n, m)
            if state is not None and col % state.g == 0:
                current = torch.cat([w[:, :i1], w1, w[:, i2:]], dim=1)[:, col:col + state.g]
                state.choose(col, current, hinv.diagonal()[col:col + state.g], n, m)
            keep = mask[:, col]
            q = torch.where(keep, w1[:, i], torch.zeros(())) if state is None else state.quantize(w1[:, i], keep, col)
            e = (w1[:, i] - q) / hinv1[i, i]
            w1[:, i:].sub_(e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0))
            err1[:, i] = e
            w1[:, i] = q
        w[:, i1:i2] = w1
        w[:, i2:].sub_(err1 @ hinv[i1:i2, i2:])
    if state is None:
        return SparseGPTResult(mask, weight=w)
    return SparseGPTResult(mask, codes=state.codes, scale=state.scale, zero_point=state.zero)


class _GridState:
    """Group qparams and codes of a quantized sweep."""

    def __init__(self, grid: QuantGrid, rows: int, k: int):
        self.grid, self.g = grid, grid.group_size
        self.codes = torch.zeros(rows, k, dtype=torch.int64)
        self.scale = self.zero = None
        self.groups = -(-k // self.g)

    def choose(self, col: int, current: torch.Tensor, hinv_diag: torch.Tensor, n: int, m: int) -> None:
        """Qparams of the group starting at ``col`` from its current weights (Note [SparseGPT N:M])."""
        provisional = nm_prune_mask(current.square() / hinv_diag.square(), n, m)
        scale, zero = self.grid.group_qparams(fill_pruned(current, provisional, m))
        if self.scale is None:
            self.scale = scale.new_empty(scale.shape[0], self.groups)
            self.zero = None if zero is None else zero.new_empty(zero.shape[0], self.groups)
        grp = col // self.g
        self.scale[:, grp] = scale[:, 0]
        if zero is not None:
            self.zero[:, grp] = zero[:, 0]

    def quantize(self, w: torch.Tensor, keep: torch.Tensor, col: int) -> torch.Tensor:
        """Column ``col`` as the layout will read it: kept entries rounded on the grid, pruned ones exactly 0 (their
        code is that of 0.0)."""
        grp = col // self.g
        zero = None if self.zero is None else self.zero[:, grp:grp + 1]
        q = torch.where(keep, w, torch.zeros(()))
        codes, deq = self.grid.quantize_columns(q.unsqueeze(1), self.scale[:, grp:grp + 1], zero)
        self.codes[:, col] = codes[:, 0].long()
        return torch.where(keep, deq[:, 0].float(), torch.zeros(()))
