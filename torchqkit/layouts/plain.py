"""PlainLayout: unpacked codes, one per element, in the qdtype's storage dtype.

Stores any integer qdtype of up to 8 bits (int8 / uint8 storage, one code per byte: no packing, so
sub-byte codes waste bits) and float8 (torch's float8 dtypes). Tensors:
  qdata:      (N, K) rounded up to whole blocks, int8 / uint8 / float8 (padding: code 0, never read back)
  scale:      (ceil(N / block_size[0]), ceil(K / block_size[1])), the scale dtype chosen at quantization
  zero_point: same shape as scale or None (ZeroPointDomain.NONE)

Linear (routes below): symmetric signed int codes stored as int8 (int8, or int2..int7 kept in int8), per-row
or group-wise, run the custom op ``torchqkit::linear_int8wo_plain``; with int8 dynamic per-token activations
(symmetric or asymmetric) and per-row weights, ``torchqkit::linear_int8da_int8_plain`` (static per-tensor int8
activation scales: ``torch._int_mm``). Float8 per-tensor / per-row runs ``torch._scaled_mm``. Everything else runs
the reference (dequantize, fake-quantize the activation, F.linear); ``torchqkit.kernels.status()`` lists each case.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.primitives import MappingType, ZeroPointDomain, pad_to, padded_shape
from ..core.qdtype import QKind, int8
from .base import Layout, PlainParts, WeightFormat, pad_features, register_layout
from .routes import GroupedRoute, Route, flatten_tokens, in_dtype_of
from .scaled_mm import SCALED_MM_ROUTES



@register_layout("plain")
@dataclass(frozen=True)
class PlainLayout(Layout):
    """Unpacked codes, one per element, in the qdtype's storage dtype (layout name ``"plain"``).

    Stores any integer qdtype of up to 8 bits (int8 / uint8 storage, one code per byte: sub-byte codes waste
    bits) and float8; not codebook formats (nf4, fp4_e2m1), which have their own layouts. Inner tensors:
    ``qdata``, ``scale`` and ``zero_point`` (None without a zero point). Symmetric signed codes stored as int8 run
    ``torchqkit::linear_int8wo_plain``, int8 x int8 dynamic activations ``torchqkit::linear_int8da_int8_plain``,
    float8 per-tensor / per-row ``torch._scaled_mm``, everything else the reference (dequantize, then
    ``F.linear``); ``torchqkit.kernels.status()`` lists each case. It is the default layout of
    ``Int8WeightOnlyConfig`` and the int8 x int8 activation configs, and the simplest to inspect.

    Example:
        ```python
        import torch
        import torchqkit as qk
        qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128, layout=qk.PlainLayout()))
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout())
        print(w.qdata.dtype, w.scale.shape)          # torch.int8 torch.Size([16, 1])
        ```
    """
    tensor_names = ("qdata", "scale", "zero_point")
    row_major = True

    def supports(self, fmt: WeightFormat):
        qdtype = fmt.qdtype
        if qdtype.kind in (QKind.CODEBOOK, QKind.FLOAT):
            return f"PlainLayout stores integer and float8 codes, not {qdtype.name} (use its own layout)"
        return None

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        block_size = fmt.block_size
        qdata = pad_to(parts.qdata, padded_shape(parts.qdata.shape, block_size))
        return {"qdata": qdata, "scale": parts.scale, "zero_point": parts.zero_point}

    def unpack(self, aqt) -> PlainParts:
        qdata = aqt.qdata[tuple(slice(0, s) for s in aqt.logical_shape)]
        return PlainParts(qdata, aqt.scale, aqt.zero_point)

    def __repr__(self) -> str:
        return "PlainLayout()"


# ------------------------------------------------------------------------------------------------
# linear
# ------------------------------------------------------------------------------------------------

def _symmetric_int8_codes(w) -> bool:
    return (w.qdtype.kind is QKind.INT and w.qdtype.signed and w.qdata.dtype == torch.int8
            and w.zero_point_domain is ZeroPointDomain.NONE and w.block_size[0] == 1)


def _int_act_per_row_weight(w) -> bool:
    """int activations x a symmetric signed int weight with one scale per row: an integer matmul applies."""
    spec = w.act_quant
    return (spec is not None and spec.qdtype == int8 and spec.group_size is None
            and w.qdtype.kind is QKind.INT and w.qdtype.signed
            and w.zero_point_domain is ZeroPointDomain.NONE and w.block_size == (1, w.logical_shape[1]))


def _dynamic_int8_applies(w, x) -> bool:
    spec = w.act_quant
    return (_int_act_per_row_weight(w) and _symmetric_int8_codes(w) and spec.static_scale is None
            and spec.mapping in (MappingType.SYMMETRIC, MappingType.ASYMMETRIC))


def _weight_only_call(fn, w, x, bias):  # block_size[0] == 1: rows are never padded, K may be
    return fn(pad_features(x, w.qdata.shape[1]), w.qdata, w.scale, bias)


def _dynamic_int8_call(fn, w, x, bias):
    return fn(x, w.qdata, w.scale, bias, w.act_quant.mapping is MappingType.SYMMETRIC)


def _weight_only_grouped_call(fn, tensors, w, x, offs):
    return fn(pad_features(x, tensors["qdata"].shape[2]), offs, tensors["qdata"], tensors["scale"])


def _dynamic_int8_grouped_call(fn, tensors, w, x, offs):
    return fn(x, offs, tensors["qdata"], tensors["scale"], w.act_quant.mapping is MappingType.SYMMETRIC)


_ANY_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _int8_dynamic_linear(w, x, bias):
    n = w.logical_shape[0]
    qa = w.act_quant.quantize(flatten_tokens(x))
    acc = torch._int_mm(qa.qdata, w.qdata.t())  # (M, N) int32, exact
    if qa.zero_point is not None:
        # x ~ (qx - zx) sx, so sum_k (qx - zx) qw = acc - zx * sum_k qw
        acc = acc - qa.zero_point.to(torch.int32) * w.qdata.sum(dim=1, dtype=torch.int32)
    out = acc.to(torch.float32) * qa.scale * w.scale.reshape(1, n).to(torch.float32)
    out = out.to(x.dtype).reshape(*x.shape[:-1], n)
    return out if bias is None else out + in_dtype_of(out, bias)


PlainLayout.routes = (
    Route("weight-only symmetric int codes in int8, per-row or group-wise",
          lambda w, x: w.act_quant is None and _symmetric_int8_codes(w),
          op="torchqkit::linear_int8wo_plain", call=_weight_only_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_int8wo_plain", _weight_only_grouped_call)),
    Route("int8 dynamic act (per token, symmetric / asymmetric) x per-row symmetric int8 weight",
          _dynamic_int8_applies, op="torchqkit::linear_int8da_int8_plain", call=_dynamic_int8_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_int8da_int8_plain", _dynamic_int8_grouped_call)),
    Route("int8 static per-tensor act (calibrated scale), or the symmetric_no_clipping_err mapping, x per-row "
          "symmetric int weight", lambda w, x: _int_act_per_row_weight(w),
          aten=_int8_dynamic_linear, aten_name="aten._int_mm",
          why="the fused int8 kernel computes per-token scales inside (symmetric / asymmetric); this case quantizes x "
              "in Python, then torch._int_mm and a rescale: exact, one extra pass over x", act_dtypes=_ANY_FLOAT),
    *SCALED_MM_ROUTES,
)
