"""TensorCoreTiledLayout: int4 weights in tiles a tensor-core kernel and a SIMD CPU kernel both stream.

Stores uint4 codes with one scale and one float-domain zero point per group of g = 32 / 64 / 128 / 256
weights along in_features (what Int4WeightOnlyConfig produces): w = (q - 8) * scale + zero.
See Note [Tensor-core tiled int4] for the exact bit arrangement. Tensors (T = inner_k_tiles):
  qdata:          int32 [N8 / 8][Kt / (16 T)][32][T / 2]
  scale_and_zero: [Kt / g][N8][2], the weight's dtype; [..., 0] = scale, [..., 1] = zero point
where N8 = out_features rounded up to 8 and Kt = in_features rounded up to lcm(g, 16 T). The padding
holds code 8, scale 1, zero 0 (the value 0.0); ``unpack`` / ``dequantize`` / ``shape`` never show it.

Linear (its route, below) runs the custom op ``torchqkit::linear_int4wo_tiled`` on these bytes as stored
(C++ CPU kernel, csrc/cpu/linear_int4wo_tiled.cpp; its pure-torch reference where no backend is built);
``torchqkit.kernels.status()`` names the backend.

Note [Tensor-core tiled int4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Codes are grouped into n-tiles of 8 output rows (the n8 of mma.m16n8k16) and k-chunks of T k16-tiles:

  qdata[i][j][l][w]      i: n-tile, rows n = 8 i + r          (r = l // 4, 0..7)
                         j: k-chunk, k in [16 T j, 16 T (j + 1))
                         l: lane = 4 r + c                    (c = l % 4, 0..3; a warp's thread id)
                         w: word, holds k16-tiles t = 2 w and 2 w + 1 of the chunk

Lane l owns exactly its mma B fragment of every k16-tile t: row n = 8 i + r and the four
k = 16 T j + 16 t + 2 c + {0, 1, 8, 9}. Nibble p of a word is bits [4 p, 4 p + 4) of the int32 value;
with p = 4 e + 2 u + h it holds tile t = 2 w + u, k offset 2 c + 8 h + e:

  bits      31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
  nibble    7       6       5       4       3       2       1       0
  tile t    2w+1    2w+1    2w      2w      2w+1    2w+1    2w      2w
  k - 16t   2c+9    2c+1    2c+9    2c+1    2c+8    2c+0    2c+8    2c+0
            |<-------- e = 1 (k odd) ------>|  |<-------- e = 0 (k even) ----->|

Why this order: ``(word >> 4 s) & 0x000F000F`` (s = 0..3) puts nibbles s and s + 4 into the two 16-bit
halves of a register: s = 0 gives (b0, b1) of tile 2 w, s = 1 its (b2, b3), s = 2, 3 the same for tile
2 w + 1, i.e. one AND / OR (with the fp16 / bf16 magic exponent) per mma operand register, no shuffles.
A GPU thread loads its T / 2 words of a chunk with one vector load.

For a CPU kernel: the codes of one row n in chunk j are the 2 T consecutive words of lanes 4 r .. 4 r + 3
(8 T bytes), covering every k of the chunk in a fixed permutation that is the same for every row and
chunk. The kernel permutes its activation chunk once and then streams each row's bytes linearly; the
8 rows of an n-tile are 64 T contiguous bytes, so a SIMD kernel computes 8 outputs per pass.

scale_and_zero is group-major: walking K, a kernel reads one contiguous row of N8 (scale, zero) pairs
per group (the shape torch's _weight_int4pack_mm family takes).

Device independence: the words are defined by their integer values (bit 0 least significant) and are
built by the same torch ops everywhere, so CPU and CUDA hold identical bytes (both little-endian). Unlike
torch's _convert_weight_to_int4pack_for_cpu, nothing depends on the CPU's ISA.

Bytes: N8 * Kt / 2 (codes) + (Kt / g) * N8 * 2 * sizeof(dtype) (scale and zero point).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.primitives import ZeroPointDomain, padded_shape
from ..core.qdtype import uint4
from ..kernels.ops.linear_int4wo_tiled import int4_tiled_codes
from .base import (FLOAT_DTYPES, Layout, PackedSpec, PlainParts, WeightFormat, kernel_reach_problem, pad_features,
                   register_layout)
from .routes import GroupedRoute, Route


GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = (2, 4, 8)
N_TILE = 8          # rows per n-tile (mma n8)
K_TILE = 16         # k per mma k16-tile
PAD_CODE = 8        # the uint4 midpoint: (8 - 8) * 1 + 0 = 0.0


def best_inner_k_tiles(in_features: int, group_size: int) -> int:
    """Note [inner_k_tiles per weight]: the tiling that pads K least, the longest (8) on a tie. K is padded to
    lcm(g, 16 T), and a decode step reads every padded byte: SmolLM2's K = 576 is 640 at T = 8 (11% more codes to
    read in six of its seven Linears and the lm_head) and 576 at T = 4. At g = 32 one decode step's int4 calls took
    1.07-1.17x less time at T = 4 (benchmarks/RESULTS.md) and the
    whole decode ran 1.07-1.12x faster (python -m benchmarks decode --alternate). Where the padding is the same, 8 (longer
    vector loads) is kept."""
    return min(sorted(INNER_K_TILES, reverse=True),
               key=lambda t: _round_up(in_features, math.lcm(group_size, K_TILE * t)))


@register_layout("tensor_core_tiled")
@dataclass(frozen=True)
class TensorCoreTiledLayout(Layout):
    """int4 weights in tiles that a tensor-core kernel and a SIMD CPU kernel both stream (layout name
    ``"tensor_core_tiled"``).

    Stores uint4 codes with one scale and one float-domain zero point per group of 32 / 64 / 128 / 256 weights
    along in_features (what ``Int4WeightOnlyConfig`` produces, and its default layout): w = (q - 8) * scale + zero.
    Inner tensors: ``qdata`` (int32 words in mma-fragment order) and ``scale_and_zero``. Its linear runs the custom
    op ``torchqkit::linear_int4wo_tiled`` on the stored bytes. The bytes are the same on every device.

    Args:
        inner_k_tiles (int | None): how many k16-tiles one lane's words cover per chunk: 2, 4 or 8 (more means
            longer vector loads and more K padding). None (default): chosen per weight, the one that pads
            in_features least (8 on a tie); the quantized tensor records the choice.

    Raises:
        ValueError: ``inner_k_tiles`` not None, 2, 4 or 8.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128, layout=qk.TensorCoreTiledLayout(inner_k_tiles=8)))
        ```
    """
    inner_k_tiles: int | None = None
    tensor_names = ("qdata", "scale_and_zero")

    def __post_init__(self):
        if self.inner_k_tiles is not None and self.inner_k_tiles not in INNER_K_TILES:
            raise ValueError(f"TensorCoreTiledLayout: inner_k_tiles must be one of {INNER_K_TILES} (or None: chosen "
                             f"per weight), got {self.inner_k_tiles!r}")

    def for_weight(self, fmt: WeightFormat) -> "TensorCoreTiledLayout":
        if self.inner_k_tiles is not None:
            return self
        return TensorCoreTiledLayout(inner_k_tiles=best_inner_k_tiles(fmt.shape[-1], fmt.block_size[-1]))

    @property
    def k_chunk(self) -> int:
        if self.inner_k_tiles is None:
            raise ValueError("TensorCoreTiledLayout(inner_k_tiles=None) has no k-chunk until a weight chooses its "
                             "tiling: use layout.for_weight(fmt), as packing does")
        return K_TILE * self.inner_k_tiles

    def supports(self, fmt: WeightFormat):
        qdtype, block_size, shape, zero_point_domain = fmt
        if qdtype != uint4:
            return (f"TensorCoreTiledLayout stores uint4 codes (Int4WeightOnlyConfig), not {qdtype.name}; "
                    f"use PackedIntxLayout or PlainLayout for other integer formats")
        if len(shape) != 2:
            return f"TensorCoreTiledLayout stores 2-d (out_features, in_features) weights, got shape {tuple(shape)}"
        if ZeroPointDomain(zero_point_domain) is not ZeroPointDomain.FLOAT:
            return (f"TensorCoreTiledLayout needs the zero point in the float domain (ZeroPointDomain.FLOAT, "
                    f"as Int4WeightOnlyConfig uses), got {ZeroPointDomain(zero_point_domain).value}")
        if block_size[0] != 1 or block_size[1] not in GROUP_SIZES:
            return (f"TensorCoreTiledLayout needs groups of {GROUP_SIZES} along in_features (block_size (1, g)), "
                    f"got block_size {tuple(block_size)}")
        return None

    def kernel_range_problem(self, parts: PlainParts, fmt: WeightFormat, act_quant) -> str | None:
        # The bf16 decode sums s * x * (128 + u) and subtracts 136 s sum x (Note [int4 bf16 decode] in
        # csrc/cpu/int4_tiled_dot_bf16.inc): per unit of |x|, up to (136 + 15) s per element of K.
        reach = float(parts.scale.float().abs().max()) * (136 + 15) * fmt.shape[-1] if parts.scale.numel() else 0.0
        return kernel_reach_problem(self, reach, "sum scale * (128 + code) over in_features in float32")

    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        block_size = fmt.block_size
        # Whole n-tiles along out_features; whole groups and whole k-chunks along in_features.
        return N_TILE if dim == 0 else math.lcm(block_size[1], self.for_weight(fmt).k_chunk)

    def padded_shape(self, shape, group_size: int) -> tuple[int, int]:
        """(N8, Kt): the stored shape of a logical (out_features, in_features) weight."""
        n, k = shape
        t = self.inner_k_tiles or best_inner_k_tiles(k, group_size)
        return _round_up(n, N_TILE), _round_up(k, math.lcm(group_size, K_TILE * t))

    def packed_specs(self, fmt: WeightFormat):
        layout = self.for_weight(fmt)
        block_size, shape = fmt.block_size, fmt.shape
        g, t = block_size[1], layout.inner_k_tiles
        n8, kt = layout.padded_shape(shape, g)
        return {"qdata": PackedSpec((n8 // N_TILE, kt // layout.k_chunk, 32, t // 2), (torch.int32,)),
                "scale_and_zero": PackedSpec((kt // g, n8, 2), FLOAT_DTYPES)}

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        if self.inner_k_tiles is None:
            return self.for_weight(fmt).pack(parts, fmt)
        block_size = fmt.block_size
        codes, scale, zero = parts.qdata, parts.scale, parts.zero_point
        if zero is None or zero.dtype != scale.dtype or not scale.dtype.is_floating_point:
            got = "none" if zero is None else zero.dtype
            raise ValueError(f"TensorCoreTiledLayout packs scale and zero point together in one float dtype; got "
                             f"scale {scale.dtype} and zero point {got}. Quantize with ZeroPointDomain.FLOAT.")
        n, k = codes.shape
        g = block_size[1]
        n8, kt = self.padded_shape((n, k), g)
        padded = torch.full((n8, kt), PAD_CODE, dtype=torch.uint8, device=codes.device)
        padded[:n, :k] = codes
        scale_and_zero = torch.zeros((kt // g, n8, 2), dtype=scale.dtype, device=scale.device)
        scale_and_zero[..., 0] = 1
        groups = scale.shape[1]  # ceil(k / g): a partial last group keeps its own scale and zero
        scale_and_zero[:groups, :n, 0] = scale.t()
        scale_and_zero[:groups, :n, 1] = zero.t()
        return {"qdata": _tile(padded, self.inner_k_tiles), "scale_and_zero": scale_and_zero}

    def narrow(self, aqt, cut):
        """Whole n-tiles along out_features, whole k-chunks (and groups) along in_features: always a view."""
        begin, length = cut.codes
        to_end = begin + length == aqt.logical_shape[cut.dim]  # keep the padded tail tile
        qdata, sz = aqt.qdata, aqt.scale_and_zero
        if cut.dim == 0:
            t0 = begin // N_TILE
            t1 = qdata.shape[0] if to_end else (begin + length) // N_TILE
            qdata, sz = qdata[t0:t1], sz[:, t0 * N_TILE: t1 * N_TILE]
        else:
            chunk, g = K_TILE * 2 * qdata.shape[3], aqt.block_size[1]  # the stored tiling
            c0 = begin // chunk
            c1 = qdata.shape[1] if to_end else (begin + length) // chunk
            qdata, sz = qdata[:, c0:c1], sz[c0 * chunk // g: c1 * chunk // g]
        return {"qdata": qdata, "scale_and_zero": sz}, self

    def unpack(self, aqt) -> PlainParts:
        n, k = aqt.logical_shape
        g = aqt.block_size[1]
        codes = int4_tiled_codes(aqt.qdata)[:n, :k]
        sz = aqt.scale_and_zero[: -(-k // g), :n]
        return PlainParts(codes, sz[..., 0].t().contiguous(), sz[..., 1].t().contiguous())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------------------------------
# tiling, see Note [Tensor-core tiled int4]
# ------------------------------------------------------------------------------------------------
# Dims of the codes (N8, Kt) split as
#   (i, r, j, w, u, h, c, e):  n = 8 i + r,  k = 16 T j + 16 (2 w + u) + 8 h + 2 c + e
# and of the words as (i, j, r, c, w, e, u, h): lane l = 4 r + c, nibble p = 4 e + 2 u + h. The inverse (words
# -> codes) is kernels/ops/linear_int4wo_tiled.int4_tiled_codes, the one decoder every reader uses.
_TO_WORDS = (0, 2, 1, 6, 3, 7, 4, 5)


def _tile(codes: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    n8, kt = codes.shape
    nt, nc, nw = n8 // N_TILE, kt // (K_TILE * inner_k_tiles), inner_k_tiles // 2
    nibbles = codes.reshape(nt, N_TILE, nc, nw, 2, 2, 4, 2).permute(_TO_WORDS).reshape(nt, nc, 32, nw, 8)
    # Nibbles 2b and 2b + 1 are byte b of the word (bits 8b .. 8b + 7), least significant byte first: the
    # int32 value is the little-endian view of those 4 bytes, on every device torch runs on (all little-endian).
    word_bytes = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).contiguous()
    return word_bytes.view(torch.int32).squeeze(-1)



# ------------------------------------------------------------------------------------------------
# ops
# ------------------------------------------------------------------------------------------------

def _int4_call(fn, w, x, bias):
    x = pad_features(x, padded_shape(w.logical_shape, w.block_size)[1])  # whole groups: every backend's contract
    return fn(x, w.qdata, w.scale_and_zero, w.block_size[1], w.logical_shape[0], bias)


def _int4_grouped_call(fn, tensors, w, x, offs):
    x = pad_features(x, padded_shape(w.logical_shape, w.block_size)[1])
    return fn(x, offs, tensors["qdata"], tensors["scale_and_zero"], w.block_size[1], w.logical_shape[0])


TensorCoreTiledLayout.routes = (
    Route("int4 weight-only (uint4, group-wise float zero point)", lambda w, x: w.act_quant is None,
          op="torchqkit::linear_int4wo_tiled", call=_int4_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_int4wo_tiled", _int4_grouped_call)),
)
