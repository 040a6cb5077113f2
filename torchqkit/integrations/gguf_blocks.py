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
  Q6_K  256 weights, 210 bytes: 128 bytes low nibbles | 64 bytes high 2-bit pairs | 16 int8 scales | d fp16.
        w = d sc_i (q - 32), i = sub-block of 16: int6 symmetric in groups of 16 (int8 storage when a
        negative scale can't be folded into the codes, see ``_fold_negative_scales``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.primitives import ZeroPointDomain
from ..core.qdtype import QDType, int5, int6, int8, uint4, uint5
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


def _q6_k(b):
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)                   # (half, low/high 32 bytes, 32)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b, 208).unsqueeze(-1)
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)                           # chunk t = 0..3 of each half
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).reshape(4, 1)) & 3
    codes = (low | (high << 4)).to(torch.int8) - 32
    return _fold_negative_scales(PlainParts(_rows(codes), _rows(d * sc), None))


def _fold_negative_scales(parts: PlainParts) -> PlainParts:
    """Q6_K's int8 sub-scales may be negative. (q, s) and (-q, -s) are the same weights; flip such groups
    so the stored scales are >= 0, where the flipped codes still fit int6 (-32 can't become +32)."""
    codes, scale, _ = parts
    g = codes.shape[1] // scale.shape[1]
    neg = scale < 0
    flip = neg.repeat_interleave(g, dim=1)
    if bool((flip & (codes == -32)).any()):
        return parts  # _q6_k_format picks int8 storage for such a tensor
    return PlainParts(torch.where(flip, -codes, codes), scale.abs(), None)


_TILED = TensorCoreTiledLayout
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q4_0", 32, 18, 32, uint4, ZeroPointDomain.FLOAT, _TILED, _q4_0),
    BlockFormat("Q4_1", 32, 20, 32, uint4, ZeroPointDomain.FLOAT, _TILED, _q4_1),
    BlockFormat("Q5_0", 32, 22, 32, int5, ZeroPointDomain.NONE, PackedIntxLayout, _q5_0),
    BlockFormat("Q5_1", 32, 24, 32, uint5, ZeroPointDomain.FLOAT, PackedIntxLayout, _q5_1),
    BlockFormat("Q8_0", 32, 34, 32, int8, ZeroPointDomain.NONE, PlainLayout, _q8_0),
    BlockFormat("Q4_K", 256, 144, 32, uint4, ZeroPointDomain.FLOAT, _TILED, _q4_k),
    BlockFormat("Q6_K", 256, 210, 16, int6, ZeroPointDomain.NONE, PackedIntxLayout, _q6_k),
)}
# Q6_K tensors with a negative sub-scale next to a -32 code keep int8 codes (8 bits instead of 6.5).
Q6_K_AS_INT8 = BlockFormat("Q6_K", 256, 210, 16, int8, ZeroPointDomain.NONE, PlainLayout, _q6_k)


def decode_blocks(fmt: BlockFormat, raw: torch.Tensor, k: int) -> tuple[BlockFormat, PlainParts]:
    """Raw GGUF bytes (rows, row_bytes) of a (rows, k) weight -> the format to store it in and its plain parts."""
    rows = raw.shape[0]
    if k % fmt.block or raw.shape[1] != k // fmt.block * fmt.block_bytes:
        raise ValueError(f"{fmt.name}: a row of {k} weights takes {k // fmt.block} blocks of {fmt.block_bytes} bytes, "
                         f"the file has {raw.shape[1]} bytes per row")
    parts = fmt.decode(raw.reshape(rows, k // fmt.block, fmt.block_bytes))
    if fmt.name == "Q6_K" and bool((parts.scale < 0).any()):
        return Q6_K_AS_INT8, parts
    return fmt, parts
