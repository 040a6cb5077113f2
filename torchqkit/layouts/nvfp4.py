"""NVFP4Layout: e2m1 weights with one float8 e4m3 scale per 16 elements of K and one float32 scale per tensor.

The NVFP4 format of NVIDIA ModelOpt and compressed-tensors' ``nvfp4-pack-quantized``, byte for byte (see
Note [NVFP4 bit layout]). Tensors (Kp = K rounded up to whole blocks of 16, Note [Partial blocks] in
core/primitives.py; padded elements are code 0):
  qdata:        (N, Kp // 2) uint8, two e2m1 codes per byte, low nibble first (MXFP4's packing)
  scale:        (N, Kp // 16) torch.float8_e4m3fn, E: each block's scale before the global one
  global_scale: (1,) float32, G: a divisor, block scale = float(E) / G
x = e2m1 * (float(E) / G). unpack() returns the block scales E / G as float32 (the oracle's ``scale_rounding=
"float8_e4m3"`` makes G a power of two, so they are exact: Note [Float8 block scales] in core/primitives.py);
pack() splits such scales back into E and G.

Note [NVFP4 bit layout]
~~~~~~~~~~~~~~~~~~~~~~~
Row-major over (N, K); block (n, b) is k = 16b .. 16b + 15, its scale byte scale[n, b] (float8 e4m3fn bits:
sign | 4 exponent bits, bias 7 | 3 mantissa bits; always > 0 here). Byte j of row n holds element 2j in its LOW
nibble and 2j + 1 in its HIGH nibble, the order of torch.float4_e2m1fn_x2, of MXFP4 (Note [MX bit layout] in
layouts/mx.py) and of compressed-tensors' pack_fp4_to_uint8. An e2m1 code is sign (bit 3) | exponent (bits 2..1,
bias 1) | mantissa (bit 0). ``global_scale`` is compressed-tensors' ``weight_global_scale`` (its dequantization
divides the block scale by it), so the three tensors are ``weight_packed``, ``weight_scale`` and
``weight_global_scale`` as that format stores them.

Linear: weight-only runs torchqkit::linear_nvfp4wo on the stored bytes (C++ on CPU: the e2m1 table of MXFP4, the
float8 block scales divided by G (the 256 possible quotients once per call), each half of a 32-weight decode step
scaled by its block's scale: Note [Groups of half a step] in csrc/cpu/linear_lowbit_isa.h); with NVFP4 activations
(NVFP4DynamicActivationNVFP4WeightConfig) the same op on the activations quantized per 16 and dequantized (Note
[Activations fake-quantized before a weight-only kernel] in routes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.primitives import pad_to, padded_shape, split_float8_scales
from ..core.qdtype import fp4_e2m1
from ..kernels.ops.common import pack_nibbles, split_nibbles
from ..kernels.ops.linear_nvfp4wo import NVFP4_BLOCK, nvfp4_block_scales
from .base import Layout, PackedSpec, PlainParts, WeightFormat, pad_features, register_layout
from .routes import GroupedRoute, Route, grouped_on_fake_quantized_input, on_fake_quantized_input


@register_layout("nvfp4")
@dataclass(frozen=True)
class NVFP4Layout(Layout):
    """NVFP4 weights: e2m1 elements, two per byte, one float8 e4m3 scale per 16 elements of K and one float32 scale
    per tensor (layout name ``"nvfp4"``).

    Byte for byte the layout of NVIDIA ModelOpt's and compressed-tensors' NVFP4 checkpoints (``weight_packed``,
    ``weight_scale``, ``weight_global_scale``). The layout of ``NVFP4WeightOnlyConfig`` and
    ``NVFP4DynamicActivationNVFP4WeightConfig``; its weight-only linear runs ``torchqkit::linear_nvfp4wo`` on the
    stored bytes. Scales come from the oracle's ``scale_rounding="float8_e4m3"``.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.fp4_e2m1, qk.PerGroup(16), qk.NVFP4Layout(),
                               scale_dtype=torch.float32, scale_rounding="float8_e4m3")
        print(w.qdata.shape, w.scale.dtype, w.global_scale)   # (16, 32) torch.float8_e4m3fn tensor([...])
        ```
    """
    tensor_names = ("qdata", "scale", "global_scale")
    row_major = False  # global_scale is one value for all rows: gather_rows can't pick rows of it
    scale_rounding = "float8_e4m3"

    def supports(self, fmt: WeightFormat):
        if fmt.qdtype is not fp4_e2m1:
            return f"NVFP4Layout stores fp4_e2m1 elements, not {fmt.qdtype.name}"
        return self.symmetric_2d_problem(fmt, "e2m1 elements with float8 block scales (NVFP4)", block_k=NVFP4_BLOCK)

    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        return NVFP4_BLOCK if dim == 1 else 1

    def packed_specs(self, fmt: WeightFormat):
        n, k = padded_shape(fmt.shape, fmt.block_size)
        return {"qdata": PackedSpec((n, k // 2), (torch.uint8,)),
                "scale": PackedSpec((n, k // NVFP4_BLOCK), (torch.float8_e4m3fn,)),
                "global_scale": PackedSpec((1,), (torch.float32,))}

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        codes = pad_to(parts.qdata, padded_shape(parts.qdata.shape, fmt.block_size))
        scale, global_scale = split_float8_scales(parts.scale, "NVFP4Layout.pack")
        return {"qdata": pack_nibbles(codes), "scale": scale.contiguous(), "global_scale": global_scale}

    def unpack(self, aqt) -> PlainParts:
        n, k = aqt.logical_shape
        codes = split_nibbles(aqt.qdata, high_first=False)
        return PlainParts(codes[:n, :k], nvfp4_block_scales(aqt.scale, aqt.global_scale), None)

    def narrow(self, aqt, cut):
        """Whole 16-element blocks along K, any rows along N; the global scale is shared by every slice."""
        per_byte = 2 if cut.dim == 1 else 1
        return {"qdata": aqt.qdata.narrow(cut.dim, cut.stored[0] // per_byte, cut.stored[1] // per_byte),
                "scale": aqt.scale.narrow(cut.dim, *cut.blocks), "global_scale": aqt.global_scale}, self

    def __repr__(self) -> str:
        return "NVFP4Layout()"


def _nvfp4_call(fn, w, x, bias):
    return fn(pad_features(x, NVFP4_BLOCK * w.scale.shape[1]), w.qdata, w.scale, w.global_scale, bias)


def _nvfp4_grouped_call(fn, tensors, w, x, offs):
    return fn(pad_features(x, NVFP4_BLOCK * tensors["scale"].shape[2]), offs, tensors["qdata"], tensors["scale"],
              tensors["global_scale"])


NVFP4Layout.routes = (
    Route("NVFP4 weight-only", lambda w, x: w.act_quant is None, op="torchqkit::linear_nvfp4wo", call=_nvfp4_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_nvfp4wo", _nvfp4_grouped_call)),
    Route("NVFP4 weights x NVFP4 dynamic activations (per token and 16 features): activations fake-quantized, "
          "then the weight-only kernel", lambda w, x: w.act_quant is not None, op="torchqkit::linear_nvfp4wo",
          call=on_fake_quantized_input(_nvfp4_call),
          grouped=GroupedRoute("torchqkit::grouped_linear_nvfp4wo",
                               grouped_on_fake_quantized_input(_nvfp4_grouped_call))),
)
