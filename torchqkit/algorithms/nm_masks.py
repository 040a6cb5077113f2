"""N:M masks from importance scores: magnitude pruning (|W|) and Wanda (|W| times the input column's norm).

Wanda (Sun et al., 2023) scores weight W[i, j] by |W[i, j]| * ||X[:, j]||_2, X the (tokens, K) inputs the Linear saw
during calibration, and keeps the highest scores of each block of M inputs of a row: no weight update, one pass of
statistics (InputStats.sq_sum). Magnitude pruning is the same with all norms equal. Both only decide the mask; the
layout stores the kept values (layouts/nm_sparse.py).
"""
from __future__ import annotations

import torch

from ..layouts.nm_format import nm_mask

__all__ = ["nm_prune_mask", "magnitude_scores", "wanda_scores", "fill_pruned"]


def nm_prune_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """bool (R, K): the ``n`` highest scores of every block of ``m`` columns (ties: the lower column). K need not be a
    multiple of ``m``: a last partial block keeps up to ``n`` of its real columns."""
    rows, k = scores.shape
    kp = -(-k // m) * m
    padded = torch.full((rows, kp), -1.0, dtype=torch.float32, device=scores.device)
    padded[:, :k] = scores.float()  # scores are >= 0, so padding (-1) is kept only where no real column is left
    return nm_mask(padded, n, m)[:, :k]


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    """|W|: magnitude pruning keeps the largest weights of each block (an N:M weight keeps exactly its nonzeros)."""
    return weight.detach().float().abs()


def wanda_scores(weight: torch.Tensor, sq_sum: torch.Tensor) -> torch.Tensor:
    """|W| * ||X_col||_2, with ``sq_sum`` (K,) the sum over calibration tokens of each input feature squared."""
    return weight.detach().float().abs() * sq_sum.double().sqrt().float().to(weight.device)


def fill_pruned(weight: torch.Tensor, mask: torch.Tensor, m: int) -> torch.Tensor:
    """``weight`` with each pruned entry replaced by the first kept value of its block of ``m``: the ranges (min, max,
    absmax) of any group of whole blocks are then those of its kept values, so qparams chosen on the result fit the
    values the layout stores, not the zeros it doesn't (Note [Sparse qparams], api/sparsify.py)."""
    rows, k = weight.shape
    kp = -(-k // m) * m
    w = torch.zeros(rows, kp, dtype=weight.dtype, device=weight.device)
    keep = torch.zeros(rows, kp, dtype=torch.bool, device=weight.device)
    w[:, :k], keep[:, :k] = weight, mask
    wb, kb = w.reshape(rows, -1, m), keep.reshape(rows, -1, m)
    first = torch.gather(wb, 2, kb.to(torch.uint8).argmax(2, keepdim=True))  # a block with no kept entry: column 0
    return torch.where(kb, wb, first).reshape(rows, kp)[:, :k]
