"""NF4Layout: NormalFloat-4 codes two per byte, one absmax scale per block of K (QLoRA), optionally with
the absmax values themselves quantized to 8 bits ("double quantization").

See Note [NF4 bit layout]. Tensors (N, K weight, B = block_size, Kp = K rounded up to whole blocks (Note
[Partial blocks] in core/primitives.py; padded codes are 7, the level 0.0), n = N * Kp // B blocks):
  qdata:             (N, Kp // 2) uint8, two codes per byte
  scale:             (N, Kp // B), the per-block absmax (float32 from NF4WeightOnlyConfig); None with double_quant
  scale_codes:       (N, Kp // B) int8, double_quant only: absmax - offset, int8 symmetric (the oracle's int8)
  scale_block_scale: (ceil(n / 256),) float32, double_quant only: one scale per 256 consecutive blocks
                     in row-major order (the last group may be partial)
  scale_offset:      (1,) float32, double_quant only: the mean of all absmax values, subtracted before quantizing
x = nf4_levels[q] * absmax. unpack() returns the absmax itself (dequantized, in float32, under
double_quant), so dequantize() is the oracle's dequantize_affine(codes, nf4, (1, B), absmax).

Note [NF4 bit layout]
~~~~~~~~~~~~~~~~~~~~~
Row-major over (N, K). Byte j of row n holds element 2j in its HIGH nibble and element 2j + 1 in its
LOW nibble (bitsandbytes' order): byte = code[n, 2j] << 4 | code[n, 2j + 1]. A code is the index into
the 16 NF4 levels (qdtype.py): 0 -> -1.0, 7 -> 0.0, 15 -> 1.0.

Note [NF4 double quantization]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
As in QLoRA (Dettmers et al. 2023, section 3): weights are quantized against their float32 absmax,
then the absmax values (one per B weights) are stored in 8 bits: offset = mean(absmax); the flat
row-major absmax - offset is cut into groups of 256, and each group gets one float32 scale (int8
symmetric, choose_qparams_affine / quantize_affine of the oracle; bitsandbytes uses a non-linear
"dynamic" 8-bit map instead). Cost per B = 64: 4 + 8/64 + 32/(64*256) bits per weight, versus 4.5.
A slice that starts inside a group of 256 (any in_features slice, most out_features slices) can't
keep the 8-bit absmax: it stores its dequantized absmax in float32 (bit-exact, NF4Layout without
double_quant) while qdata stays a view; out_features slices starting on a group boundary keep it.

Linear (routes below; float32 / bfloat16 / float16 activations) runs ``torchqkit::linear_nf4wo`` on these bytes
as stored (C++ CPU kernels decode the double-quantized absmax per block); its autograd formula gives the input
(and bias) gradients, so QLoRA adapters train through the frozen weight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..core.primitives import choose_qparams_affine, dequantize_affine, pad_to, padded_shape, quantize_affine
from ..core.qdtype import int8, nf4
from ..kernels.ops.common import split_nibbles
from .base import FLOAT_DTYPES, Layout, PackedSpec, PlainParts, WeightFormat, pad_features, register_layout
from .routes import GroupedRoute, Route

DQ_GROUP = 256  # absmax values per second-level scale (QLoRA)
NF4_ZERO_CODE = 7  # the level 0.0: what padding past K holds
_DQ_NAMES = ("scale_codes", "scale_block_scale", "scale_offset")


@register_layout("nf4")
@dataclass(frozen=True)
class NF4Layout(Layout):
    """NormalFloat-4 codes two per byte with one absmax scale per block of K (QLoRA), optionally with the absmax
    values themselves stored in 8 bits (layout name ``"nf4"``).

    ``NF4WeightOnlyConfig`` builds it from its own ``block_size`` and ``double_quant``. x = nf4_levels[q] * absmax;
    bytes hold element 2j in the high nibble and 2j + 1 in the low nibble (bitsandbytes' order). Its linear runs
    ``torchqkit::linear_nf4wo`` on the stored bytes, and gradients reach the input, so QLoRA adapters train through
    the frozen weight.

    Args:
        block_size (int): weights per absmax along a row: a positive even int (codes pack two per byte); default 64.
        double_quant (bool): store the absmax values as int8 with one float32 scale per 256 blocks and a
            global offset; default False.

    Raises:
        ValueError: ``block_size`` not a positive even int.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(16, 128), qk.qdtypes.nf4, qk.PerGroup(64), qk.NF4Layout(block_size=64),
                               scale_dtype=torch.float32)
        print(w.qdata.shape)                          # torch.Size([16, 64]): two codes per byte
        ```
    """
    block_size: int = 64
    double_quant: bool = False
    tensor_names = ("qdata", "scale", *_DQ_NAMES)
    row_major = True

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"NF4Layout: block_size must be a positive even int (codes pack two per byte), "
                             f"got {self.block_size!r}")
        object.__setattr__(self, "double_quant", bool(self.double_quant))

    def supports(self, fmt: WeightFormat):
        if fmt.qdtype is not nf4:
            return f"NF4Layout stores nf4 codes, not {fmt.qdtype.name}"
        return self.symmetric_2d_problem(fmt, "absmax-scaled codes", block_k=self.block_size)

    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        # Along K, a slice must keep whole bytes (two codes) even when K is one block.
        return max(super().slice_multiple(fmt, dim), 2 if dim == 1 else 1)

    def packed_specs(self, fmt: WeightFormat):
        n, k = padded_shape(fmt.shape, fmt.block_size)
        blocks = (n, k // self.block_size)
        specs = {"qdata": PackedSpec((n, k // 2), (torch.uint8,))}
        if not self.double_quant:
            return {**specs, "scale": PackedSpec(blocks, FLOAT_DTYPES)}
        return {**specs, "scale_codes": PackedSpec(blocks, (torch.int8,)),
                "scale_block_scale": PackedSpec((-(-n * blocks[1] // DQ_GROUP),), (torch.float32,)),
                "scale_offset": PackedSpec((1,), (torch.float32,))}

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        block_size = fmt.block_size
        codes = pad_to(parts.qdata, padded_shape(parts.qdata.shape, block_size), NF4_ZERO_CODE)
        qdata = (codes[:, 0::2] << 4) | codes[:, 1::2]
        tensors = {"qdata": qdata.contiguous(), "scale": parts.scale, **dict.fromkeys(_DQ_NAMES)}
        if self.double_quant:
            tensors.update(zip(_DQ_NAMES, _double_quantize(parts.scale)))
            tensors["scale"] = None
        return tensors

    def unpack(self, aqt) -> PlainParts:
        n, k = aqt.logical_shape
        q = aqt.qdata
        codes = split_nibbles(q, high_first=True)[:, :k]
        if not self.double_quant:
            return PlainParts(codes, aqt.scale, None)
        return PlainParts(codes, _double_dequantize(aqt.scale_codes, aqt.scale_block_scale, aqt.scale_offset), None)

    def narrow(self, aqt, cut):
        """qdata is always a view. See Note [NF4 double quantization] for when the 8-bit absmax survives."""
        per_byte = 2 if cut.dim else 1
        tensors, layout = {"qdata": aqt.qdata.narrow(cut.dim, cut.stored[0] // per_byte, cut.stored[1] // per_byte)}, self
        blocks_per_row = aqt.scale_codes.shape[1] if self.double_quant else 0
        if not self.double_quant:
            tensors["scale"] = aqt.scale.narrow(cut.dim, *cut.blocks)
        elif cut.dim == 0 and (cut.blocks[0] * blocks_per_row) % DQ_GROUP == 0:
            first, count = cut.blocks[0] * blocks_per_row // DQ_GROUP, -(-cut.blocks[1] * blocks_per_row // DQ_GROUP)
            tensors.update(scale_codes=aqt.scale_codes.narrow(0, *cut.blocks),
                           scale_block_scale=aqt.scale_block_scale.narrow(0, first, count))
        else:
            absmax = _double_dequantize(aqt.scale_codes, aqt.scale_block_scale, aqt.scale_offset)
            tensors.update(scale=absmax.narrow(cut.dim, *cut.blocks).contiguous(), **dict.fromkeys(_DQ_NAMES))
            layout = replace(layout, double_quant=False)
        if cut.block_size[1] != layout.block_size:  # K was one block and the slice shrank it
            layout = replace(layout, block_size=cut.block_size[1])
        return tensors, layout

    def gather_rows(self, aqt, rows):
        # Double quantization shares one second-level scale across 256 consecutive blocks of several rows.
        return None if self.double_quant else super().gather_rows(aqt, rows)

    def stored_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """The absmax unpack() returns for a tensor packed with ``scale``: see Note [NF4 double quantization]."""
        return _double_dequantize(*_double_quantize(scale)) if self.double_quant else scale

    def __repr__(self) -> str:
        return f"NF4Layout(block_size={self.block_size}, double_quant={self.double_quant})"


def _double_quantize(absmax: torch.Tensor):
    """absmax (N, K // B) -> (int8 codes (N, K // B), float32 scale per 256 blocks, float32 offset (1,))."""
    absmax = absmax.float()
    offset = absmax.mean().reshape(1)
    if not offset.is_meta and not torch.isfinite(offset).all():  # absmax near float32's max: the float32 sum overflows, the mean doesn't
        offset = absmax.double().mean().float().reshape(1)
    flat = F.pad((absmax - offset).reshape(-1), (0, -absmax.numel() % DQ_GROUP))  # zeros don't change absmax
    scale, _ = choose_qparams_affine(flat, int8, (DQ_GROUP,), name="NF4 absmax (double quantization)")
    codes = quantize_affine(flat, int8, (DQ_GROUP,), scale, name="NF4 absmax (double quantization)")
    return codes[:absmax.numel()].reshape(absmax.shape), scale, offset


def _double_dequantize(codes: torch.Tensor, block_scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    flat = F.pad(codes.reshape(-1), (0, block_scale.numel() * DQ_GROUP - codes.numel()))
    vals = dequantize_affine(flat, int8, (DQ_GROUP,), block_scale, name="NF4 absmax codes")
    return (vals[:codes.numel()] + offset).reshape(codes.shape)


def _nf4_call(fn, w, x, bias):
    return fn(pad_features(x, 2 * w.qdata.shape[1]), w.qdata, w.scale, w.scale_codes, w.scale_block_scale,
              w.scale_offset, w.qlayout.block_size, bias)


def _nf4_grouped_call(fn, tensors, w, x, offs):
    return fn(pad_features(x, 2 * tensors["qdata"].shape[2]), offs, tensors["qdata"], tensors["scale"],
              tensors["scale_codes"], tensors["scale_block_scale"], tensors["scale_offset"], w.qlayout.block_size)


NF4Layout.routes = (
    Route("nf4 weight-only, single or double quant (QLoRA training included)",
          lambda w, x: w.act_quant is None, op="torchqkit::linear_nf4wo", call=_nf4_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_nf4wo", _nf4_grouped_call)),
)
