"""torchqkit::sdpa_quantized_kv_cache: attention over a quantized KV cache, read from its codes.

softmax(query key^T * scale + mask) value over the n cached positions, where each of key and value is stored as
codes + scales (+ zero points) for positions [0, nq) and as float rows (the "tail") for [nq, n):

    query      (B, Hq, Lq, D)           float; the Lq queries are the last Lq of the n positions
    *_codes    (B, Hkv, >= nq, D)       uint8: int8 / float8 codes, one per byte
               (B, Hkv, >= nq, ceil(D/2))      int4: element 2i in the low nibble of byte i, 2i + 1 in the high one
    *_scale    per token:   (B, Hkv, >= nq, D // group)            float16
               per channel: (B, Hkv, >= ceil(nq / group), D)       float16 (keys only: a scale per channel and per
                                                                   block of `group` positions)
    *_zero     int formats: the scale's shape; float8: empty
    *_tail     (B, Hkv, >= n - nq, D)   float32, position nq + i in row i
    *_counts   int64 [n, nq]            n equal for key and value; nq may differ (per-channel keys quantize whole
                                        blocks of positions only)
    attn_mask  None (causal: query l at position n - Lq + l) or bool (True = visible) / additive float,
               broadcastable to (B, Hq, Lq, >= n); its columns [0, n) are read

Values of a code (the formats' one decoder in Python, `kv_rows`): int8 / int4 codes are unsigned with a float zero
point (core's ZeroPointDomain.FLOAT): x = (q - mid) * scale + zero, mid = 128 / 8; float8 codes are the format's
bits: x = float8(q) * scale. The reference decodes the rows and runs sdpa; the C++ CPU kernel
(csrc/cpu/quantized_kv_attention*.cpp) decodes one row at a time as it reads it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core import qdtypes
from ...core.primitives import ZeroPointDomain, dequantize_affine
from ..registry import define_op

__all__ = ["KV_FORMATS", "kv_rows", "sdpa_quantized_kv_cache_ref", "unpack_int4_codes"]

# The code formats of a quantized KV cache and the qdtype whose codes they store.
KV_FORMATS = {"int8": qdtypes.uint8, "int4": qdtypes.uint4, "float8_e4m3fn": qdtypes.float8_e4m3fn,
              "float8_e5m2": qdtypes.float8_e5m2}


def unpack_int4_codes(packed: torch.Tensor, d: int) -> torch.Tensor:
    """(..., ceil(d / 2)) bytes -> (..., d) codes 0..15: element 2i from the low nibble of byte i."""
    both = torch.stack([packed & 15, packed >> 4], dim=-1)
    # the explicit width: a cache with no quantized position yet hands over 0 rows, where -1 is ambiguous
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])[..., :d]


def kv_rows(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, tail: torch.Tensor, counts, fmt: str,
            group: int, per_channel: bool, d: int | None = None) -> torch.Tensor:
    """The float32 rows (B, H, n, D) of one side of the cache (module docstring): positions [0, nq) decoded from their
    codes by core's dequantize_affine, [nq, n) taken from the tail."""
    n, nq = (int(c) for c in counts.tolist())
    d = tail.shape[-1] if d is None else d
    if nq == 0:  # nothing quantized yet (the first positions of a per-channel or residual cache): core can't tile 0
        return tail[:, :, :n].float()
    qdtype = KV_FORMATS[fmt]
    c = codes[:, :, :nq]
    if fmt == "int4":
        c = unpack_int4_codes(c, d)
    elif qdtype.storage_dtype != torch.uint8:
        c = c.view(qdtype.storage_dtype)  # float8 bits
    block = (1, 1, group, 1) if per_channel else (1, 1, 1, group)
    rows = -(-nq // group) if per_channel else nq
    s = scale[:, :, :rows]
    if fmt.startswith("float8"):
        decoded = dequantize_affine(c, qdtype, block, s)
    else:
        decoded = dequantize_affine(c, qdtype, block, s, zero[:, :, :rows], zero_point_domain=ZeroPointDomain.FLOAT)
    return torch.cat([decoded, tail[:, :, :n - nq].float()], dim=2)


def sdpa_quantized_kv_cache_ref(query, k_codes, k_scale, k_zero, k_tail, k_counts, v_codes, v_scale, v_zero, v_tail,
                                v_counts, attn_mask, scale: float, enable_gqa: bool, k_format: str, k_group: int,
                                k_per_channel: bool, v_format: str, v_group: int) -> torch.Tensor:
    """The decoded K and V rows through sdpa (module docstring): the definition the kernels are tested against."""
    key = kv_rows(k_codes, k_scale, k_zero, k_tail, k_counts, k_format, k_group, k_per_channel, query.shape[-1])
    value = kv_rows(v_codes, v_scale, v_zero, v_tail, v_counts, v_format, v_group, False)
    n, lq = key.shape[2], query.shape[2]
    if attn_mask is None:
        # Causal with the queries at the end: query l sees positions [0, n - lq + l].
        attn_mask = torch.ones(lq, n, dtype=torch.bool, device=query.device).tril(n - lq)
    else:
        attn_mask = attn_mask[..., :n]
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
    out = F.scaled_dot_product_attention(query.float(), key, value, attn_mask=attn_mask, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.to(query.dtype)


def _fake(query, k_codes, k_scale, k_zero, k_tail, k_counts, v_codes, v_scale, v_zero, v_tail, v_counts, attn_mask,
          scale, enable_gqa, k_format, k_group, k_per_channel, v_format, v_group):
    return query.new_empty(*query.shape[:-1], v_tail.shape[-1])


define_op("torchqkit::sdpa_quantized_kv_cache",
          "(Tensor query, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor k_tail, Tensor k_counts, "
          "Tensor v_codes, Tensor v_scale, Tensor v_zero, Tensor v_tail, Tensor v_counts, Tensor? attn_mask, "
          "float scale, bool enable_gqa, str k_format, int k_group, bool k_per_channel, str v_format, int v_group) "
          "-> Tensor",
          reference=sdpa_quantized_kv_cache_ref, fake=_fake)
