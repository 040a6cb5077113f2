"""Integer codes packed into int32 words: the packings of compressed-tensors, GPTQ and AWQ checkpoints.

All three formats store b-bit unsigned fields in little-endian bit streams of int32 words; they differ only in
which axis is packed and in what order the codes of one word come.

Note [int32 bit streams]
~~~~~~~~~~~~~~~~~~~~~~~~
Along the packed axis, field j of a row is bits [j b, (j + 1) b) of the stream, and stream bit s is bit s % 32
of word s // 32 (least significant first). With b dividing 32 every word holds 32 / b whole fields and
the last word of a row is completed with zero fields. This module serves b in (2, 4, 8) only: these are the
widths for which compressed-tensors' dense packing (>= 0.20, fields may straddle words) and its earlier
32 // b fields-per-word packing give the same words, and the widths GPTQ / AWQ checkpoints use. Where each
format puts the stream:
  compressed-tensors ``weight_packed``: (N, ceil(K b / 32)), rows of W along K; field = code + 2^(b-1)
      (signed codes in offset binary). ``weight_zero_point`` (asymmetric): (ceil(N b / 32), G), packed
      along N (dim 0), same offset.
  GPTQ ``qweight``: (K b / 32, N), the stream of each column of W^T along K: qweight = stream(W).T;
      ``qzeros``: (G, N b / 32), packed along N.
  AWQ (GEMM) ``qweight``: (K, N b / 32) packed along N, but field j of each word of 8 is column
      AWQ_ORDER[j] of its 8 (0 2 4 6 1 3 5 7); ``qzeros`` (G, N b / 32) likewise.
"""
from __future__ import annotations

import torch

__all__ = ["PACKED_BITS", "AWQ_ORDER", "pack_int32", "unpack_int32", "awq_interleave", "awq_deinterleave",
           "stream_padding_is_zero"]

PACKED_BITS = (2, 4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field j of an AWQ word holds column AWQ_ORDER[j] of its group of 8


def _check_bits(bits: int) -> None:
    if bits not in PACKED_BITS:
        raise ValueError(f"int32 packing of {bits}-bit codes is not served (widths: {PACKED_BITS})")


def pack_int32(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) unsigned fields in [0, 2^bits) -> (R, ceil(C bits / 32)) int32 words (Note [int32 bit streams])."""
    _check_bits(bits)
    per_word = 32 // bits
    rows, cols = fields.shape
    words = -(-cols // per_word)
    padded = torch.zeros(rows, words * per_word, dtype=torch.int64)
    padded[:, :cols] = fields.to(torch.int64)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    packed = (padded.reshape(rows, words, per_word) << shifts).sum(dim=-1)  # < 2^32: exact in int64
    return (packed - (packed >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32)  # two's complement view


def unpack_int32(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """(R, W) int32 words -> (R, cols) unsigned fields as uint8, the first ``cols`` of each row's stream."""
    _check_bits(bits)
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    fields = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # int64: no sign smearing
    return fields.reshape(words.shape[0], -1)[:, :cols].to(torch.uint8)


def stream_padding_is_zero(words: torch.Tensor, bits: int, cols: int) -> bool:
    """Whether the fields after the first ``cols`` of each row (the last word's completion) are all zero, as every
    writer of these formats leaves them: a nonzero one means the words were packed for another width or shape."""
    fields = unpack_int32(words, bits, words.shape[1] * (32 // bits))
    return not bool(fields[:, cols:].any())


def awq_interleave(columns: torch.Tensor) -> torch.Tensor:
    """(R, C) fields in column order -> the order AWQ packs them (C a multiple of 8)."""
    return columns.reshape(columns.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(columns.shape)


def awq_deinterleave(fields: torch.Tensor) -> torch.Tensor:
    """Inverse of ``awq_interleave``: AWQ's packed order -> column order."""
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c is field inverse[c]: 0 4 1 5 2 6 3 7
    return fields.reshape(fields.shape[0], -1, 8)[..., inverse].reshape(fields.shape)
