"""GGUF (llama.cpp) block formats, decoded straight into torchqkit's plain form: codes, scales, zero points.

Each decoder takes a tensor's raw bytes as GGUF stores them, ``(rows, row_bytes)`` uint8 with ``K / block``
blocks per row, and returns ``PlainParts`` in the oracle's shapes (codes (rows, K), scale and zero point
(rows, K / group)) plus how to store them. No value is re-rounded: codes are copied bit for bit and scales
are the format's own (fp16 scales widened to float32, times a 6-bit or int8 sub-scale where the format has
one: exact in float32). Dequantized, a tensor equals llama.cpp's / gguf-py's dequantization within one float32
rounding (``(q - mid) * s + z`` here versus ``q * s + m`` there).

Block layouts (ggml-common.h; little-endian; "fp16" is IEEE half):
  Q4_0  32 weights, 18 bytes: d fp16 | 16 bytes, element j in the low nibble of byte j, j + 16 in its high
        nibble. w = d (q - 8): uint4, float-domain zero 0 (d may be negative: llama.cpp picks its sign).
  Q4_1  32 weights, 20 bytes: d fp16 | m fp16 | nibbles as Q4_0. w = d q + m: uint4, zero z = m + 8 d.
  Q5_0  32 weights, 22 bytes: d fp16 | qh uint32 (bit j = 5th bit of element j) | nibbles as Q4_0.
        w = d (q - 16): int5 codes q - 16, no zero point.
  Q5_1  32 weights, 24 bytes: d fp16 | m fp16 | qh | nibbles. w = d q + m: uint5, zero z = m + 16 d.
  Q8_0  32 weights, 34 bytes: d fp16 | 32 int8. w = d q: int8, no zero point.
  Q4_K  256 weights, 144 bytes: d fp16 | dmin fp16 | 12 bytes of eight 6-bit (scale, min) pairs | 128 bytes:
        sub-block j (32 weights) is the low (j even) or high (j odd) nibbles of bytes 32 (j // 2) ...
        w = d sc_j q - dmin m_j: uint4 in groups of 32, scale d sc_j, zero 8 d sc_j - dmin m_j.
  Q5_K  256 weights, 176 bytes: d fp16 | dmin fp16 | 12 bytes of (scale, min) pairs as Q4_K | 32 bytes qh |
        128 bytes of nibbles as Q4_K; bit j of qh byte l is the 5th bit of element l of sub-block j.
        w = d sc_j q - dmin m_j: uint5 in groups of 32, scale d sc_j, zero 16 d sc_j - dmin m_j.
  Q2_K  256 weights, 84 bytes: 16 bytes of (scale low nibble, min high nibble) | 64 bytes of 2-bit codes |
        d fp16 | dmin fp16. Sub-block 8 h + 2 j + p (16 weights) is bits 2 j of bytes 32 h + 16 p ... + 15.
        w = d sc q - dmin m: uint2 in groups of 16, scale d sc, zero 2 d sc - dmin m.
  Q3_K  256 weights, 110 bytes: 32 bytes hmask | 64 bytes of 2-bit codes laid out as Q2_K | 12 bytes of
        sixteen 6-bit scales | d fp16. q = low 2 bits - 4 unless bit 4 h + j of hmask byte 16 p + l is set.
        w = d (sc - 32) q: int3 symmetric in groups of 16 (negative scales folded into the codes as Q6_K's,
        int8 storage when a -4 code meets a negative scale).
  Q6_K  256 weights, 210 bytes: 128 bytes low nibbles | 64 bytes high 2-bit pairs | 16 int8 scales | d fp16.
        w = d sc_i (q - 32), i = sub-block of 16: int6 symmetric in groups of 16 (int8 storage when a
        negative scale can't be folded into the codes, see ``_fold_negative_scales``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.primitives import ZeroPointDomain
from ..core.qdtype import QDType, int3, int5, int6, int8, uint2, uint4, uint5
from ..layouts.base import Layout, PlainParts
from ..layouts.packed_intx import PackedIntxLayout
from ..layouts.plain import PlainLayout
from ..layouts.tensor_core_tiled import TensorCoreTiledLayout

__all__ = ["BlockFormat", "BLOCK_FORMATS"]


@dataclass(frozen=True)
class BlockFormat:
    name: str                 # GGML type name
    block: int                # weights per block
    block_bytes: int
    group: int                # weights per torchqkit scale
    qdtype: QDType
    zero_point_domain: ZeroPointDomain
    layout: Callable[[], Layout]
    decode: Callable[[torch.Tensor], PlainParts]  # (rows, n_blocks, block_bytes) uint8 -> parts

    def describe(self) -> str:
        return f"{self.qdtype.name} g{self.group} {self.layout()!r}"


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte offset ``at`` of every block, as float32 (rows, n_blocks)."""
    return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles_low_then_high(qs: torch.Tensor) -> torch.Tensor:
    """(rows, n_blocks, 16) bytes -> (rows, n_blocks, 32) codes: 16 low nibbles, then 16 high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(rows, n_blocks, 4) little-endian uint32 bytes -> (rows, n_blocks, 32) bit j of the word, as uint8."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # (.., 4 bytes, 8 bits)
    return bits.reshape(*qh.shape[:-1], 32)


def _rows(codes: torch.Tensor) -> torch.Tensor:
    return codes.reshape(codes.shape[0], -1)


def _q4_0(b):
    d = _f16(b, 0)
    return PlainParts(_rows(_nibbles_low_then_high(b[..., 2:18])), d, torch.zeros_like(d))


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    return PlainParts(_rows(_nibbles_low_then_high(b[..., 4:20])), d, m + 8 * d)


def _q5_codes(b, qh_at):
    low = _nibbles_low_then_high(b[..., qh_at + 4:qh_at + 20])
    return low | (_high_bits(b[..., qh_at:qh_at + 4]) << 4)


def _q5_0(b):
    codes = _q5_codes(b, 2).to(torch.int8) - 16
    return PlainParts(_rows(codes), _f16(b, 0), None)


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    return PlainParts(_rows(_q5_codes(b, 4)), d, m + 16 * d)


def _q8_0(b):
    return PlainParts(_rows(b[..., 2:34].contiguous().view(torch.int8)), _f16(b, 0), None)


def _k_scale_min(s: torch.Tensor):
    """(rows, n_blocks, 12) bytes -> six-bit (scale, min) of the 8 sub-blocks, each (rows, n_blocks, 8).
    Bytes 0-3: scales 0-3 (low 6 bits; top 2 bits = bits 4-5 of scales 4-7); bytes 4-7: mins 0-3 likewise
    for mins 4-7; bytes 8-11: low nibble = low 4 bits of scales 4-7, high nibble = of mins 4-7."""
    a, m, lo = s[..., 0:4].long(), s[..., 4:8].long(), s[..., 8:12].long()
    sc = torch.cat([a & 63, (lo & 0xF) | ((a >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (lo >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _q4_k(b):
    d, dmin = _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)                    # 4 chunks of 32 bytes
    codes = torch.stack([qs & 0xF, qs >> 4], dim=-2)                       # (.., 4, 2, 32): sub-block 2c + h
    scale = d * sc
    return PlainParts(_rows(codes), _rows(scale), _rows(8 * scale - dmin * mn))


def _q5_k(b):
    d, dmin = _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)
    sc, mn = _k_scale_min(b[..., 4:16])
    qh = b[..., 16:48]                                                      # (.., 32)
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32)   # sub-block j = 2c + h
    high = (qh.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1
    scale = d * sc
    return PlainParts(_rows(low | (high << 4)), _rows(scale), _rows(16 * scale - dmin * mn))


def _two_bit_codes(qs: torch.Tensor) -> torch.Tensor:
    """(.., 64) bytes -> (.., 16, 16) codes of the 16 sub-blocks (8 h + 2 j + p) in Q2_K / Q3_K order."""
    qs = qs.reshape(*qs.shape[:-1], 2, 1, 2, 16)                            # (half h, -, part p, l)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).reshape(4, 1, 1)
    return ((qs >> shifts) & 3).reshape(*qs.shape[:-4], 16, 16)           # (h, j, p) -> sub-block


def _q2_k(b):
    sc = b[..., 0:16]
    d, dmin = _f16(b, 80).unsqueeze(-1), _f16(b, 82).unsqueeze(-1)
    scale = d * (sc & 0xF).float()
    return PlainParts(_rows(_two_bit_codes(b[..., 16:80])), _rows(scale), _rows(2 * scale - dmin * (sc >> 4).float()))


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """(.., 12) bytes -> sixteen 6-bit scales (.., 16): bytes 0-7 give the low nibbles (scales 0-7 from the low
    nibbles of bytes 0-7, 8-15 from their high nibbles), bytes 8-11 the top 2 bits (scale 4 q + i from bits
    2 q of byte 8 + i)."""
    lo, top = s[..., 0:8].long(), s[..., 8:12].long()
    high = torch.cat([(top >> (2 * q)) & 3 for q in range(4)], dim=-1)    # scales 0-3, 4-7, 8-11, 12-15
    return torch.cat([lo & 0xF, lo >> 4], dim=-1) | (high << 4)


def _q3_k(b):
    hmask = b[..., 0:32].reshape(*b.shape[:-1], 1, 1, 2, 16)               # (-, -, part p, l)
    bit = torch.arange(8, dtype=torch.uint8).reshape(2, 4, 1, 1)            # (half h, j): bit 4 h + j
    high = ((hmask >> bit) & 1).reshape(*b.shape[:-1], 16, 16)
    codes = _two_bit_codes(b[..., 32:96]).to(torch.int8) - 4 * (1 - high.to(torch.int8))
    d = _f16(b, 108).unsqueeze(-1)
    scale = d * (_q3_k_scales(b[..., 96:108]) - 32).float()
    return _fold_negative_scales(PlainParts(_rows(codes), _rows(scale), None), qmin=-4)


def _q6_k(b):
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)                   # (half, low/high 32 bytes, 32)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b, 208).unsqueeze(-1)
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)                           # chunk t = 0..3 of each half
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).reshape(4, 1)) & 3
    codes = (low | (high << 4)).to(torch.int8) - 32
    return _fold_negative_scales(PlainParts(_rows(codes), _rows(d * sc), None), qmin=-32)


def _fold_negative_scales(parts: PlainParts, qmin: int) -> PlainParts:
    """Q6_K's and Q3_K's sub-scales may be negative. (q, s) and (-q, -s) are the same weights; flip such groups
    so the stored scales are >= 0, where the flipped codes still fit (int6's -32 can't become +32, int3's -4
    can't become +4)."""
    codes, scale = parts.qdata, parts.scale
    g = codes.shape[1] // scale.shape[1]
    neg = scale < 0
    flip = neg.repeat_interleave(g, dim=1)
    if bool((flip & (codes == qmin)).any()):
        return parts  # decode_blocks picks int8 storage for such a tensor
    return PlainParts(torch.where(flip, -codes, codes), scale.abs(), None)


_TILED = TensorCoreTiledLayout
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q4_0", 32, 18, 32, uint4, ZeroPointDomain.FLOAT, _TILED, _q4_0),
    BlockFormat("Q4_1", 32, 20, 32, uint4, ZeroPointDomain.FLOAT, _TILED, _q4_1),
    BlockFormat("Q5_0", 32, 22, 32, int5, ZeroPointDomain.NONE, PackedIntxLayout, _q5_0),
    BlockFormat("Q5_1", 32, 24, 32, uint5, ZeroPointDomain.FLOAT, PackedIntxLayout, _q5_1),
    BlockFormat("Q8_0", 32, 34, 32, int8, ZeroPointDomain.NONE, PlainLayout, _q8_0),
    BlockFormat("Q4_K", 256, 144, 32, uint4, ZeroPointDomain.FLOAT, _TILED, _q4_k),
    BlockFormat("Q5_K", 256, 176, 32, uint5, ZeroPointDomain.FLOAT, PackedIntxLayout, _q5_k),
    BlockFormat("Q2_K", 256, 84, 16, uint2, ZeroPointDomain.FLOAT, PackedIntxLayout, _q2_k),
    BlockFormat("Q3_K", 256, 110, 16, int3, ZeroPointDomain.NONE, PackedIntxLayout, _q3_k),
    BlockFormat("Q6_K", 256, 210, 16, int6, ZeroPointDomain.NONE, PackedIntxLayout, _q6_k),
)}
# Q6_K / Q3_K tensors with a negative sub-scale next to a qmin code keep int8 codes (8 bits instead of 6.5 / 3.4).
AS_INT8 = {name: BlockFormat(name, 256, BLOCK_FORMATS[name].block_bytes, 16, int8, ZeroPointDomain.NONE, PlainLayout,
                             BLOCK_FORMATS[name].decode) for name in ("Q3_K", "Q6_K")}


def decode_blocks(fmt: BlockFormat, raw: torch.Tensor, k: int) -> tuple[BlockFormat, PlainParts]:
    """Raw GGUF bytes (rows, row_bytes) of a (rows, k) weight -> the format to store it in and its plain parts."""
    rows = raw.shape[0]
    if k % fmt.block or raw.shape[1] != k // fmt.block * fmt.block_bytes:
        raise ValueError(f"{fmt.name}: a row of {k} weights takes {k // fmt.block} blocks of {fmt.block_bytes} bytes, "
                         f"the file has {raw.shape[1]} bytes per row")
    parts = fmt.decode(raw.reshape(rows, k // fmt.block, fmt.block_bytes))
    if fmt.name in AS_INT8 and bool((parts.scale < 0).any()):
        return AS_INT8[fmt.name], parts
    return fmt, parts
