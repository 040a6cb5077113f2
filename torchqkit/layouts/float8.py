"""Float8Layout: float8 e4m3fn / e5m2 codes with per-tensor, per-row or per-block (e.g. 128x128) scales.

Bit layout (device-independent): ``qdata`` is the row-major (N, K) weight, one byte per element, the
byte being the element's float8 bits (e4m3fn: sign | 4 exponent bits, bias 7 | 3 mantissa bits;
e5m2: sign | 5 exponent bits, bias 15 | 2 mantissa bits), stored as torch.float8_e4m3fn / float8_e5m2.
Tensors:
  qdata: (N, K) rounded up to whole blocks, torch.float8_e4m3fn or torch.float8_e5m2 (padding: 0.0)
  scale: (ceil(N / block_size[0]), ceil(K / block_size[1])), float32: (1, 1) per tensor, (N, 1) per row,
         (ceil(N / 128), ceil(K / 128)) for 128x128 blocks
x = float(q) * scale, elements saturated at the format's max when quantized.

Linear: with float8 dynamic / static activations and per-tensor / per-row weight scales it runs
``torch._scaled_mm`` (layouts/scaled_mm.py, shared with PlainLayout); weight-only (any scale granularity,
float32 / bfloat16 / float16 activations) runs ``torchqkit::linear_fp8wo`` on these bytes (C++ CPU kernels);
per-block scales with float8 activations, KernelPreference.REFERENCE: the reference, dequantize + F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..core.primitives import ZeroPointDomain, pad_to, padded_shape
from ..core.qdtype import QKind
from ..kernels import KERNEL_ACT_DTYPES, cpu_backend
from ..tensor.activation import KernelPreference
from ..tensor.dispatch import fill_defaults
from ..tensor.reference import reference_linear
from .base import Layout, PackedSpec, PlainParts, crop_features, pad_features, register_layout, scale_specs
from .scaled_mm import scaled_mm_applies, scaled_mm_linear
from .slicing import block_slice

aten = torch.ops.aten


@register_layout("float8")
@dataclass(frozen=True)
class Float8Layout(Layout):
    tensor_names = ("qdata", "scale")
    row_major = True

    def supports(self, qdtype, block_size, shape, zero_point_domain):
        if qdtype.kind is not QKind.FLOAT8:
            return f"Float8Layout stores float8_e4m3fn / float8_e5m2 codes, not {qdtype.name}"
        if ZeroPointDomain(zero_point_domain) is not ZeroPointDomain.NONE:
            return "Float8Layout stores symmetric float8 codes: no zero point"
        if len(shape) != 2:
            return f"Float8Layout stores 2-d weights, got shape {tuple(shape)}"
        return None

    def packed_specs(self, qdtype, block_size, shape, zero_point_domain):
        return {"qdata": PackedSpec(padded_shape(shape, block_size), (qdtype.storage_dtype,)),
                **scale_specs(shape, block_size, zero_point_domain)}

    def pack(self, parts: PlainParts, qdtype, block_size, zero_point_domain):
        if parts.qdata.dtype != qdtype.storage_dtype:
            raise ValueError(f"Float8Layout.pack: codes must be {qdtype.storage_dtype}, got {parts.qdata.dtype}")
        qdata = pad_to(parts.qdata, padded_shape(parts.qdata.shape, block_size))
        return {"qdata": qdata.contiguous(), "scale": parts.scale}

    def unpack(self, aqt) -> PlainParts:
        n, k = aqt.logical_shape
        return PlainParts(aqt.qdata[:n, :k], aqt.scale, None)

    def __repr__(self) -> str:
        return "Float8Layout()"

    @staticmethod
    def linear_paths() -> list[dict]:
        """What serves F.linear for each kind of float8 weight (read by torchqkit.kernels.status())."""
        fp8, fp8_why = cpu_backend(_FP8_OP)
        return [
            {"linear": "float8 act x per-tensor / per-row float8 weight", "path": "aten._scaled_mm",
             "why": "torch's CPU _scaled_mm is itself a slow reference implementation"},
            {"linear": "float8 act x per-block (e.g. 128x128) float8 weight", "path": "reference",
             "why": "_scaled_mm has no scales inside K; fake-quantized activation + dequantized weight"},
            {"linear": "weight-only float8 (per tensor / row / block scales)", "path": f"{_FP8_OP} ({fp8})",
             "why": fp8_why},
            {"linear": "any, KernelPreference.REFERENCE", "path": "reference", "why": "chosen explicitly"},
        ]


_FP8_OP = "torchqkit::linear_fp8wo"


@Float8Layout.ops.implements(F.linear)
def _linear(w, x, bias):
    if scaled_mm_applies(w):
        return scaled_mm_linear(w, x, bias)
    if w.act_quant is None and w.kernel_preference is KernelPreference.AUTO and x.dtype in KERNEL_ACT_DTYPES:
        # Rows padded to whole blocks (e.g. 128 x 128) run with a zero-padded bias and are cropped off.
        rows, cols = w.qdata.shape
        bias = None if bias is None else pad_features(bias, rows)
        y = torch.ops.torchqkit.linear_fp8wo(pad_features(x, cols), w.qdata, w.scale, bias)
        return crop_features(y, w.logical_shape[0])
    return reference_linear(w, x, bias)


@Float8Layout.ops.implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    """Whole blocks along either dim; both inner tensors are views of the original storage."""
    self, dim, start, end, step = fill_defaults(args, 5, [0, None, None, 1])
    cut = block_slice(self, dim, start, end, step)
    out = self.with_changes({"qdata": self.qdata.narrow(cut.dim, *cut.stored),
                             "scale": self.scale.narrow(cut.dim, *cut.blocks)},
                            logical_shape=cut.logical_shape, block_size=cut.block_size)
    return return_and_correct_aliasing(func, args, kwargs, out)
