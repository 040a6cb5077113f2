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

Linear: with float8 dynamic / static activations and per-tensor / per-row weight scales it runs
``torch._scaled_mm`` (layouts/scaled_mm.py, shared with PlainLayout); weight-only (any scale granularity,
float32 / bfloat16 / float16 activations) runs ``torchqkit::linear_fp8wo`` on these bytes (C++ CPU kernels);
per-block scales with float8 activations: the reference, dequantize + F.linear (routes below).
"""
from __future__ import annotations

from dataclasses import dataclass


from ..core.primitives import pad_to, padded_shape
from ..core.qdtype import QKind
from .base import Layout, PlainParts, WeightFormat, crop_features, pad_features, register_layout
from .routes import GroupedRoute, Route
from .scaled_mm import SCALED_MM_ROUTES



@register_layout("float8")
@dataclass(frozen=True)
class Float8Layout(Layout):
    """float8 codes (e4m3fn, e5m2, or AMD's e4m3fnuz / e5m2fnuz) with per-tensor, per-row or per-block float32
    scales (layout name ``"float8"``).

    ``qdata`` is the row-major (N, K) weight, one float8 element per byte; ``scale`` has one value per block.
    The default layout of the float8 configs. With float8 activations and per-tensor / per-row scales its linear
    runs ``torch._scaled_mm``; weight-only it runs ``torchqkit::linear_fp8wo``; per-block scales with float8
    activations run the reference (dequantize, then ``F.linear``).

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


def _fp8_call(fn, w, x, bias):
    # Rows padded to whole blocks (e.g. 128 x 128) run with a zero-padded bias and are cropped off.
    rows, cols = w.qdata.shape
    bias = None if bias is None else pad_features(bias, rows)
    return crop_features(fn(pad_features(x, cols), w.qdata, w.scale, bias), w.logical_shape[0])


def _fp8_grouped_call(fn, tensors, w, x, offs):
    qdata = tensors["qdata"]  # rows padded to whole blocks: cropped off the output
    return crop_features(fn(pad_features(x, qdata.shape[2]), offs, qdata, tensors["scale"]), w.logical_shape[0])


Float8Layout.routes = (
    *SCALED_MM_ROUTES,
    Route("weight-only float8 (per tensor / row / block scales)", lambda w, x: w.act_quant is None,
          op="torchqkit::linear_fp8wo", call=_fp8_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_fp8wo", _fp8_grouped_call)),
)
