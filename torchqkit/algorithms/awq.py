"""AWQ (Lin et al., 2023): activation-aware weight quantization, without changing the number format.

Input channels that see large activations matter more, so before rounding the weight's columns are scaled
up by s (and the input down by s, folded into the op that produces it): ``x W^T = (x / s)(W s)^T``.
``awq_scales`` searches s = mean|x|^r over r in [0, 1) for the smallest output error of the quantized
Linears sharing that input (r = 0 is plain round-to-nearest, so the search never does worse on its own
objective). ``awq_clip`` then searches, per output row and group, how far to shrink the weight range
before rounding: outliers clipped, the other values get finer steps.

``fake_quantize(w) -> w'`` is the caller's weight format (quantize then dequantize): AWQ only changes what
that format is given.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["awq_scales", "awq_clip", "CLIP_ROWS"]

FakeQuantize = Callable[[torch.Tensor], torch.Tensor]

# The clipping search scores every (row, group) at 11 ratios: on this many sampled token rows (AutoAWQ: 512)
CLIP_ROWS = 512


def awq_scales(x: torch.Tensor | Sequence[torch.Tensor], mean_abs: torch.Tensor, weights: Sequence[torch.Tensor],
               fake_quantizers: Sequence[FakeQuantize], n_grid: int = 20) -> tuple[torch.Tensor, float]:
    """(s (K,), the chosen ratio r) for Linears of weights (N_i, K) sharing input rows x (T, K), or, with ``x`` a
    sequence, each weight i meeting its own rows x[i] (T_i, K): the experts of a MoE layer, each on the tokens
    routed to it. The objective is the squared output error summed over every weight's rows."""
    shared = isinstance(x, torch.Tensor)
    xs = [x.float()] if shared else [t.float() for t in x]
    refs = [torch.cat([xs[0] @ w.float().t() for w in weights], dim=1)] if shared else \
        [t @ w.float().t() for t, w in zip(xs, weights)]
    count = max(sum(r.numel() for r in refs), 1)
    best = (float("inf"), None, 0.0)
    for i in range(n_grid):
        r = i / n_grid
        s = mean_abs.float().pow(r).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # keep the product of scales near 1: the norms and weights stay in range
        if shared:
            out = torch.cat([(xs[0] / s) @ fq(w.float() * s).float().t() for w, fq in zip(weights, fake_quantizers)],
                            dim=1)
            loss = float((out - refs[0]).square().mean())
        else:
            loss = sum(float(((t / s) @ fq(w.float() * s).float().t() - ref).square().sum())
                       for t, w, fq, ref in zip(xs, weights, fake_quantizers, refs)) / count
        if loss < best[0]:
            best = (loss, s, r)
    return best[1], best[2]


def awq_clip(x: torch.Tensor, w: torch.Tensor, fake_quantize: FakeQuantize, group_size: int,
             n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """``w`` (N, K) with each (row, group) clamped to +-ratio x its max |w|, the ratio (1 down to 1 - max_shrink
    in steps of 1 / n_grid) that minimises that group's share of the output error on inputs x (T, K)."""
    n, k = w.shape
    g = min(group_size, k)
    groups = -(-k // g)
    pad = groups * g - k
    w = w.float()
    xg = torch.nn.functional.pad(x.float(), (0, pad)).reshape(-1, groups, g)

    def grouped(t):  # (N, K) -> (N, G, g), zero padded
        return torch.nn.functional.pad(t, (0, pad)).reshape(n, groups, g)

    max_abs = grouped(w).abs().amax(dim=-1, keepdim=True)  # (N, G, 1)
    best_err = torch.full((n, groups), float("inf"))
    best_max = max_abs.clone()
    for i in range(int(max_shrink * n_grid) + 1):
        limit = max_abs * (1 - i / n_grid)
        clamped = torch.maximum(torch.minimum(grouped(w), limit), -limit).reshape(n, -1)[:, :k]
        diff = grouped(w - fake_quantize(clamped).float())
        err = torch.einsum("tgk,ngk->tng", xg, diff).square().sum(dim=0)  # (N, G)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better.unsqueeze(-1), limit, best_max)
    return torch.maximum(torch.minimum(grouped(w), best_max), -best_max).reshape(n, -1)[:, :k]
