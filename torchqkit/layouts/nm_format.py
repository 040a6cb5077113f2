"""The storage format of N:M sparse weights: which values of each block of M survive, and where they sat.

Note [N:M sparse storage]
~~~~~~~~~~~~~~~~~~~~~~~~~
A weight (R, K) is N:M sparse when every block of M consecutive values along K (columns m b .. m b + M - 1)
has at most N nonzeros; K is a multiple of M (a layout pads K first, with zeros). It is stored as two tensors:
  kept:      (R, K / M * N), the N kept values of each block in increasing position order, in any dtype (float
             values, or the integer codes a quantized layout then packs). A block with fewer than N nonzeros keeps
             its lowest-positioned pruned entries as explicit zeros, so every block holds exactly N entries.
  positions: uint8 (R, ceil(K / M * N * b / 8)), entry j's position inside its block (0 .. M - 1) as a b-bit
             field, b = position_bits(M) (2 for 2:4), in the little-endian bit stream of Note [Packed intx bits]
             (layouts/packed_intx.py): field j occupies stream bits [j b, (j + 1) b), stream bit s is bit s % 8 of
             byte s // 8. For 2:4 one byte holds the positions of two blocks: bits 0-1 and 2-3 the first block's.
Kept entry j of a row belongs to block j // N, so its column is (j // N) * M + position[j]. A kernel computes
y[r] = sum_j w(kept[r, j]) * x[(j // N) * M + position[r, j]]: it reads N / M of the values and b * N / M bits of
positions per weight (2:4 with int8 values: 0.625 of the dense int8 bytes).
"""
from __future__ import annotations

import torch

from ..kernels.ops.linear_intxwo import intx_fields, pack_intx_fields
from ..kernels.ops.linear_nm_sparse_wo import position_bits

__all__ = ["position_bits", "check_pattern", "nm_mask", "check_nm_mask", "pack_nm", "unpack_nm", "nm_columns"]


def check_pattern(n: int, m: int, what: str = "sparsity pattern") -> None:
    """Raise ValueError unless 1 <= n < m <= 128 (positions fit the 7-bit fields Note [Packed intx bits] packs)."""
    if not (isinstance(n, int) and isinstance(m, int)) or not 1 <= n < m <= 128:
        raise ValueError(f"{what} ({n}, {m}) is not an N:M pattern: it needs integers 1 <= N < M <= 128 "
                         f"(N values kept out of every M consecutive ones), e.g. (2, 4)")


def _blocks(t: torch.Tensor, m: int, what: str) -> torch.Tensor:
    if t.dim() != 2 or t.shape[1] % m:
        raise ValueError(f"{what} of shape {tuple(t.shape)} can't be split into blocks of {m} along its last dim: "
                         f"it needs 2 dims and a last dim divisible by {m} (pad K to a multiple of {m} first)")
    return t.reshape(t.shape[0], t.shape[1] // m, m)


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest-scoring entries of every block of ``m`` along the last dim (ties: lower column first).

    Args:
        scores: (R, K) importance of each weight (``|W|`` for magnitude pruning, ``|W| * ||X_col||`` for Wanda);
            K a multiple of ``m``.
        n, m: the pattern.

    Returns:
        bool (R, K): True where the weight is kept; exactly ``n`` per block.
    """
    check_pattern(n, m)
    b = _blocks(scores, m, "scores")
    # A stable descending sort keeps the lower column first among equal scores, so the mask is deterministic.
    order = torch.sort(b.float(), dim=-1, descending=True, stable=True).indices[..., :n]
    mask = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, order, True)
    return mask.reshape(scores.shape)


def check_nm_mask(mask: torch.Tensor, n: int, m: int, what: str = "mask") -> None:
    """Raise ValueError naming ``what`` and the first offending row / block if a block keeps more than ``n``."""
    counts = _blocks(mask, m, what).sum(-1)
    bad = (counts > n).nonzero()
    if bad.numel():
        r, blk = (int(v) for v in bad[0])
        raise ValueError(f"{what} is not {n}:{m} sparse: row {r}, block {blk} (columns {blk * m}..{blk * m + m - 1}) "
                         f"keeps {int(counts[r, blk])} values; at most {n} of every {m} may be nonzero")


def pack_nm(dense: torch.Tensor, mask: torch.Tensor, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, positions) of Note [N:M sparse storage] for the entries of ``dense`` where ``mask`` is True.

    Blocks whose mask keeps fewer than ``n`` entries are completed with their lowest-positioned unmasked entries,
    stored as zero (cast to ``dense``'s dtype), so ``unpack_nm`` gives ``dense * mask`` exactly.

    Args:
        dense: (R, K) values or integer codes; K a multiple of ``m``.
        mask: bool (R, K), at most ``n`` True per block.
        n, m: the pattern.

    Returns:
        kept (R, K / m * n) in ``dense``'s dtype and positions uint8 (Note [N:M sparse storage]).

    Raises:
        ValueError: a pattern that isn't N:M, shapes that don't match or don't split into blocks, a block keeping
            more than ``n`` entries.
    """
    check_pattern(n, m)
    if mask.shape != dense.shape or mask.dtype != torch.bool:
        raise ValueError(f"pack_nm: mask must be a bool tensor of the weight's shape {tuple(dense.shape)}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    check_nm_mask(mask, n, m)
    mb = _blocks(mask, m, "weight")
    # Kept entries first (in position order), then the lowest unmasked positions to fill each block up to n.
    rank = (~mb).to(torch.int64) * m + torch.arange(m, device=dense.device)
    pos = torch.sort(rank, dim=-1).values[..., :n] % m
    vals = torch.gather(_blocks(dense, m, "weight"), -1, pos)
    vals = torch.where(torch.gather(mb, -1, pos), vals, torch.zeros((), dtype=dense.dtype, device=dense.device))
    rows = dense.shape[0]
    positions = pack_intx_fields(pos.reshape(rows, -1).to(torch.uint8), position_bits(m))
    return vals.reshape(rows, -1), positions


def nm_columns(positions: torch.Tensor, n: int, m: int, k: int) -> torch.Tensor:
    """int64 (R, K / m * n): the column of every kept entry, (j // n) * m + position[j]."""
    check_pattern(n, m)
    if k % m:
        raise ValueError(f"nm_columns: K = {k} is not a multiple of m = {m}")
    pos = intx_fields(positions, position_bits(m), k // m * n)
    block = torch.arange(k // m * n, device=positions.device) // n
    return block * m + pos


def unpack_nm(kept: torch.Tensor, positions: torch.Tensor, n: int, m: int, k: int) -> torch.Tensor:
    """The dense (R, ``k``) tensor of ``kept`` values at their columns, zeros elsewhere (``pack_nm``'s inverse)."""
    cols = nm_columns(positions, n, m, k)
    if kept.shape != cols.shape:
        raise ValueError(f"unpack_nm: kept has shape {tuple(kept.shape)} but the positions describe "
                         f"{tuple(cols.shape)} entries for K = {k}, {n}:{m}")
    out = torch.zeros(kept.shape[0], k, dtype=kept.dtype, device=kept.device)
    return out.scatter_(1, cols, kept)
