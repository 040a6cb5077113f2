"""FP6Layout: FP6 (e3m2 / e2m3) codes, four in three bytes, with float scales per row or per group of K.

Tensors (Kp = K rounded up to whole groups, Note [Partial blocks] in core/primitives.py; padded codes are 0):
  qdata: (N, ceil(Kp * 6 / 8)) uint8, see Note [FP6 bit layout]
  scale: (N, ceil(K / group)), the scale dtype chosen at quantization (the weight's by default)
x = fp6_value(code) * scale, codes as Note [FP6 codes] in core/qdtype.py defines them (nearest value, saturating).

Note [FP6 bit layout]
~~~~~~~~~~~~~~~~~~~~~
Each row is a little-endian stream of 6-bit codes, PackedIntxLayout's packing at 6 bits (Note [Packed intx bits] in
layouts/packed_intx.py): code k occupies stream bits [6k, 6k + 6), stream bit s is bit s % 8 of byte s // 8. So
codes 4j .. 4j + 3 fill bytes 3j .. 3j + 2 exactly: byte 3j = c0 | (c1 & 3) << 6, byte 3j + 1 = c1 >> 2 |
(c2 & 15) << 4, byte 3j + 2 = c2 >> 4 | c3 << 2. A code is sign (bit 5) | exponent | mantissa (e3m2: 3 + 2
bits, bias 3; e2m3: 2 + 3 bits, bias 1). Example, e3m2 codes [0b001100 (1.0), 0b101100 (-1.0), 0, 0b011111
(28.0)] -> bytes [0x0C, 0x0B, 0x7C]. Rows start on a byte; slices along K cut at multiples of 4 codes.

Linear: weight-only runs torchqkit::linear_fp6wo on the stored bytes (C++ on CPU: the 6-bit codes cut into 16-bit
lanes and looked up as bf16 values at AVX-512, turned into fp16 bits and converted at AVX2); the reference (dequantize
+ F.linear) serves the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.primitives import pad_to, padded_shape
from ..core.qdtype import fp6_e2m3, fp6_e3m2
from ..kernels.ops.linear_intxwo import intx_fields, pack_intx_fields
from .base import Layout, PackedSpec, PlainParts, WeightFormat, pad_features, register_layout, scale_specs
from .routes import GroupedRoute, Route

_FP6 = (fp6_e3m2, fp6_e2m3)
_CODES_PER_3_BYTES = 4


def _row_bytes(k: int) -> int:
    return -(-k * 6 // 8)


@register_layout("fp6")
@dataclass(frozen=True)
class FP6Layout(Layout):
    """FP6 weights (``fp6_e3m2`` or ``fp6_e2m3`` codes), four codes in three bytes, with a float scale per row or per
    group along K (layout name ``"fp6"``).

    The layout of ``FP6WeightOnlyConfig``: 6 bits per weight plus the scales. Its linear runs
    ``torchqkit::linear_fp6wo`` on the stored bytes.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.fp6_e3m2, qk.PerRow(), qk.FP6Layout())
        print(w.qdata.shape)          # torch.Size([16, 48]): 64 codes in 48 bytes
        ```
    """
    tensor_names = ("qdata", "scale")
    row_major = True

    def supports(self, fmt: WeightFormat):
        if fmt.qdtype not in _FP6:
            return f"FP6Layout stores fp6_e3m2 / fp6_e2m3 codes, not {fmt.qdtype.name}"
        problem = self.symmetric_2d_problem(fmt, "symmetric FP6 codes")
        if problem is None and fmt.block_size[0] != 1:
            return f"FP6Layout stores one scale per row or per group of a row, got block_size {tuple(fmt.block_size)}"
        return problem

    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        if dim == 0:
            return 1
        block = fmt.block_size[1]
        return _CODES_PER_3_BYTES if block == fmt.shape[1] else math.lcm(_CODES_PER_3_BYTES, block)

    def packed_specs(self, fmt: WeightFormat):
        stored_k = padded_shape(fmt.shape, fmt.block_size)[1]
        return {"qdata": PackedSpec((fmt.shape[0], _row_bytes(stored_k)), (torch.uint8,)),
                **scale_specs(fmt.shape, fmt.block_size, fmt.zero_point_domain)}

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        codes = pad_to(parts.qdata, (parts.qdata.shape[0], padded_shape(parts.qdata.shape, fmt.block_size)[1]))
        return {"qdata": pack_intx_fields(codes, 6), "scale": parts.scale}

    def unpack(self, aqt) -> PlainParts:
        codes = intx_fields(aqt.qdata, 6, aqt.logical_shape[1]).to(torch.uint8)
        return PlainParts(codes, aqt.scale, None)

    def narrow(self, aqt, cut):
        """Rows along N; whole 3-byte units (and groups) along K: always a view."""
        if cut.dim == 0:
            qdata = aqt.qdata.narrow(0, *cut.codes)
        else:
            first = _row_bytes(cut.codes[0])  # a multiple of 4 codes (slice_multiple): a whole byte
            qdata = aqt.qdata.narrow(1, first, _row_bytes(cut.codes[0] + cut.stored[1]) - first)
        return {"qdata": qdata, "scale": aqt.scale.narrow(cut.dim, *cut.blocks)}, self

    def __repr__(self) -> str:
        return "FP6Layout()"


def _fp6_call(fn, w, x, bias):
    k = padded_shape(w.logical_shape, w.block_size)[1]  # kernels read whole groups (zero-padded x)
    return fn(pad_features(x, k), w.qdata, w.scale, 3 if w.qdtype is fp6_e3m2 else 2, bias)


def _fp6_grouped_call(fn, tensors, w, x, offs):
    k = padded_shape(w.logical_shape, w.block_size)[1]
    return fn(pad_features(x, k), offs, tensors["qdata"], tensors["scale"], 3 if w.qdtype is fp6_e3m2 else 2)


FP6Layout.routes = (
    Route("FP6 weight-only", lambda w, x: w.act_quant is None, op="torchqkit::linear_fp6wo", call=_fp6_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_fp6wo", _fp6_grouped_call)),
)
