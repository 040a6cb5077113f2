"""Float8Layout: float8 e4m3fn / e5m2 / e4m3fnuz / e5m2fnuz codes with per-tensor, per-row or per-block (e.g.
128x128) scales.

Bit layout (device-independent): ``qdata`` is the row-major (N, K) weight, one byte per element, the
byte being the element's float8 bits (e4m3fn: sign | 4 exponent bits, bias 7 | 3 mantissa bits;
e5m2: sign | 5 exponent bits, bias 15 | 2 mantissa bits; AMD's e4m3fnuz / e5m2fnuz: the same fields with bias 8 / 16,
0x80 the only NaN, Note [float8 fnuz] in core/qdtype.py), stored as the torch float8 dtype of that name.
Tensors:
  qdata: (N, K) rounded up to whole blocks, torch.float8_e4m3fn, float8_e5m2, float8_e4m3fnuz or float8_e5m2fnuz
         (padding: 0.0)
  scale: (ceil(N / block_size[0]), ceil(K / block_size[1])), float32: (1, 1) per tensor, (N, 1) per row,
         (ceil(N / 128), ceil(K / 128)) for 128x128 blocks
x = float(q) * scale, elements saturated at the format's max when quantized.

Linear: weight-only (any scale granularity, float32 / bfloat16 / float16 activations) runs ``torchqkit::linear_fp8wo``
on these bytes (C++ CPU kernels); with float8 dynamic / static activations on a CPU, the same op on the activation
quantized and dequantized (any weight scales); elsewhere, per-tensor / per-row weight scales run ``torch._scaled_mm``
(layouts/scaled_mm.py, shared with PlainLayout) and per-block scales the reference, dequantize + F.linear (routes
below).
"""
from __future__ import annotations

from dataclasses import dataclass


from ..core.primitives import pad_to, padded_shape
from ..core.qdtype import QKind
from .base import Layout, PlainParts, WeightFormat, register_layout
from .routes import GroupedRoute, Route
from .scaled_mm import SCALED_MM_ROUTES, fp8_weight_only_call, fp8_weight_only_grouped_call



@register_layout("float8")
@dataclass(frozen=True)
class Float8Layout(Layout):
    """float8 codes (e4m3fn, e5m2, or AMD's e4m3fnuz / e5m2fnuz) with per-tensor, per-row or per-block float32
    scales (layout name ``"float8"``).

    ``qdata`` is the row-major (N, K) weight, one float8 element per byte; ``scale`` has one value per block.
    The default layout of the float8 configs. Weight-only its linear runs ``torchqkit::linear_fp8wo``, and so does
    float8 x float8 on a CPU (on the fake-quantized activation); on a GPU float8 x float8 with per-tensor / per-row
    scales runs ``torch._scaled_mm``, with per-block scales the reference (dequantize, then ``F.linear``).

    Example:
        ```python
        import torch
        import torchqkit as qk
        qk.quantize_(model, qk.Float8WeightOnlyConfig(layout=qk.Float8Layout()))
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.float8_e4m3fn, qk.PerRow(), qk.Float8Layout(),
                               scale_dtype=torch.float32)
        ```
    """
    tensor_names = ("qdata", "scale")
    row_major = True

    def supports(self, fmt: WeightFormat):
        if fmt.qdtype.kind is not QKind.FLOAT8:
            return (f"Float8Layout stores float8 codes (float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz), "
                    f"not {fmt.qdtype.name}")
        return self.symmetric_2d_problem(fmt, "symmetric float8 codes")

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        qdtype, block_size = fmt.qdtype, fmt.block_size
        if parts.qdata.dtype != qdtype.storage_dtype:
            raise ValueError(f"Float8Layout.pack: codes must be {qdtype.storage_dtype}, got {parts.qdata.dtype}")
        qdata = pad_to(parts.qdata, padded_shape(parts.qdata.shape, block_size))
        return {"qdata": qdata.contiguous(), "scale": parts.scale}

    def unpack(self, aqt) -> PlainParts:
        n, k = aqt.logical_shape
        return PlainParts(aqt.qdata[:n, :k], aqt.scale, None)

    def __repr__(self) -> str:
        return "Float8Layout()"


Float8Layout.routes = (
    *SCALED_MM_ROUTES,
    Route("weight-only float8 (per tensor / row / block scales)", lambda w, x: w.act_quant is None,
          op="torchqkit::linear_fp8wo", call=fp8_weight_only_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_fp8wo", fp8_weight_only_grouped_call)),
)
