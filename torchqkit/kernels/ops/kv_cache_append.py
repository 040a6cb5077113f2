"""torchqkit::kv_cache_append: new K / V positions written into one side of a quantized KV cache layer, in place.

    kv_cache_append(codes, scale, zero, tail, counts, states, fmt, group, per_channel, residual_length, name) -> ()

states (B, H, T, D) are appended after the counts' n positions; positions that leave the float tail are quantized in
one pass (Note [Quantized KV cache layout] below: the tensors, which positions stay float). The reference quantizes
with core's choose_qparams_affine / quantize_affine (`quantize_kv`); the C++ CPU kernel (csrc/cpu/kv_cache_append.cpp)
computes the same codes, scales and zero points bit for bit. Decoding is the attention op's `kv_rows`
(sdpa_quantized_kv_cache.py), the formats' one decoder. A custom op so that a compiled decode step keeps static
shapes: the lengths live in `counts` and only this op reads them. A refused call (a position past the capacity,
NaN / Inf states) changes nothing.
"""
from __future__ import annotations

import torch

from ...core.primitives import MappingType, ZeroPointDomain, choose_qparams_affine, quantize_affine
from ..registry import define_op
from .sdpa_quantized_kv_cache import KV_FORMATS

__all__ = ["quantize_kv", "pack_int4_codes", "code_width", "kv_cache_append", "kv_cache_append_ref"]

# Note [Quantized KV cache layout]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# One side (keys or values) of one layer, B batch rows, H kv heads, D head dim, capacity S positions:
#   codes  (B, H, S, D) uint8, or (B, H, S, ceil(D / 2)) for int4 (element 2i in the low nibble of byte i)
#   scale  per token (B, H, S, D / g), per channel (B, H, ceil(S / g), D); float16
#   zero   int formats: the scale's shape, float16 (x = (q - mid) * scale + zero, core's FLOAT zero-point domain,
#          asymmetric min / max range); float8: empty (x = float8(q) * scale, absmax range)
#   tail   (B, H, T, D) float32: the positions not quantized yet, oldest first
#   counts int64 [n, nq]: n positions cached, [0, nq) as codes, [nq, n) in the tail
# Positions are quantized as soon as they are more than `residual_length` behind the newest one and, per channel,
# their whole block of g positions is: nq = floor(max(0, n - residual_length) / block) * block with block = g per
# channel and 1 per token. The tail therefore never holds more than residual_length + block - 1 positions, whatever
# a call appends, and a prefill of T positions quantizes all but those in one pass. float16 scales and zeros keep the
# overhead at 2 bytes per group (4 with a zero point): int8 with groups of 64 is 68 bytes per 64 values.


def code_width(fmt: str, d: int) -> int:
    """Bytes of codes per row of d values."""
    return (d + 1) // 2 if fmt == "int4" else d


def pack_int4_codes(codes: torch.Tensor) -> torch.Tensor:
    """(..., d) codes 0..15 -> (..., ceil(d / 2)) bytes, element 2i in the low nibble of byte i."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_kv(x: torch.Tensor, fmt: str, group: int, per_channel: bool, name: str = "kv"):
    """Rows x (B, H, T, D) -> (codes, scale, zero) in the cache's layout (Note [Quantized KV cache layout]), with
    core's choose_qparams_affine / quantize_affine: asymmetric min / max ranges for int8 / int4, absmax for float8.
    Per channel, T must be a multiple of `group`."""
    qdtype = KV_FORMATS[fmt]
    block = (1, 1, group, 1) if per_channel else (1, 1, 1, group)
    x = x.float()
    if fmt.startswith("float8"):
        scale, _ = choose_qparams_affine(x, qdtype, block, scale_dtype=torch.float16, name=name)
        codes = quantize_affine(x, qdtype, block, scale, name=name).view(torch.uint8)
        return codes, scale, scale.new_empty(0)
    scale, zero = choose_qparams_affine(x, qdtype, block, mapping=MappingType.ASYMMETRIC,
                                        zero_point_domain=ZeroPointDomain.FLOAT, scale_dtype=torch.float16,
                                        zero_point_dtype=torch.float16, name=name)
    codes = quantize_affine(x, qdtype, block, scale, zero, zero_point_domain=ZeroPointDomain.FLOAT, name=name)
    codes = codes.to(torch.uint8)
    return (pack_int4_codes(codes) if fmt == "int4" else codes), scale, zero


def kv_cache_append_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, tail: torch.Tensor,
                        counts: torch.Tensor, states: torch.Tensor, fmt: str, group: int, per_channel: bool,
                        residual_length: int, name: str) -> None:
    """Append states (B, H, T, D) to one side of a layer in place (module docstring)."""
    n, nq = (int(c) for c in counts.tolist())
    new_n = n + states.shape[2]
    if new_n > codes.shape[2]:
        raise ValueError(f"{name}: {states.shape[2]} new positions after {n} need {new_n}, past the cache's "
                         f"max_length={codes.shape[2]}; build the QuantizedKVCache with a larger max_length")
    block = group if per_channel else 1
    new_nq = max(nq, (max(0, new_n - residual_length) // block) * block)
    pending = torch.cat([tail[:, :, :n - nq].float(), states.float()], dim=2)  # positions [nq, new_n)
    if new_nq > nq:
        c, s, z = quantize_kv(pending[:, :, :new_nq - nq], fmt, group, per_channel, name)
        codes[:, :, nq:new_nq] = c
        rows = slice(nq // group, new_nq // group) if per_channel else slice(nq, new_nq)
        scale[:, :, rows] = s
        if zero.numel():
            zero[:, :, rows] = z
    keep = pending[:, :, new_nq - nq:]
    tail[:, :, :keep.shape[2]] = keep
    counts.copy_(torch.tensor([new_n, new_nq], dtype=counts.dtype))


def _fake(codes, scale, zero, tail, counts, states, fmt, group, per_channel, residual_length, name) -> None:
    return None


define_op("torchqkit::kv_cache_append",
          "(Tensor(a!) codes, Tensor(b!) scale, Tensor(c!) zero, Tensor(d!) tail, Tensor(e!) counts, Tensor states, "
          "str fmt, int group, bool per_channel, int residual_length, str name) -> ()",
          reference=kv_cache_append_ref, fake=_fake)


def kv_cache_append(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, tail: torch.Tensor,
                    counts: torch.Tensor, states: torch.Tensor, fmt: str, group: int, per_channel: bool,
                    residual_length: int, name: str) -> None:
    """Call torchqkit::kv_cache_append (module docstring): the C++ CPU kernel where it is built, else the reference."""
    torch.ops.torchqkit.kv_cache_append(codes, scale, zero, tail, counts, states, fmt, group, per_channel,
                                        residual_length, name)
