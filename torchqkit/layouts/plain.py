"""PlainLayout: unpacked codes, one per element, in the qdtype's storage dtype.

Stores any integer qdtype of up to 8 bits (int8 / uint8 storage, one code per byte: no packing, so
sub-byte codes waste bits) and float8 (torch's float8 dtypes). Tensors:
  qdata:      (N, K) rounded up to whole blocks, int8 / uint8 / float8 (padding: code 0, never read back)
  scale:      (ceil(N / block_size[0]), ceil(K / block_size[1])), the scale dtype chosen at quantization
  zero_point: same shape as scale or None (ZeroPointDomain.NONE)

Linear (KernelPreference.AUTO): symmetric signed int codes stored as int8 (int8, or int2..int7 kept in
int8), per-row or group-wise, run the custom op ``torchqkit::linear_int8wo_plain``; with int8 dynamic
per-token activations (symmetric or asymmetric) and per-row weights, ``torchqkit::linear_int8da_int8_plain``
(static per-tensor int8 activation scales: ``torch._int_mm``; C++ CPU kernels, pure-torch reference elsewhere; ``torchqkit.kernels.status()`` names the backend). Float8
per-tensor / per-row runs ``torch._scaled_mm``. Everything else, and KernelPreference.REFERENCE, runs the
reference (dequantize, fake-quantize the activation, F.linear).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..core.primitives import MappingType, ZeroPointDomain, pad_to, padded_shape
from ..core.qdtype import QKind
from ..kernels import cpu_backend
from ..tensor.activation import KernelPreference
from ..tensor.dispatch import fill_defaults
from ..tensor.reference import flatten_tokens, reference_linear
from .base import Layout, PackedSpec, PlainParts, pad_features, register_layout, scale_specs
from .scaled_mm import scaled_mm_applies, scaled_mm_linear
from .slicing import block_slice

aten = torch.ops.aten


@register_layout("plain")
@dataclass(frozen=True)
class PlainLayout(Layout):
    tensor_names = ("qdata", "scale", "zero_point")
    row_major = True

    def supports(self, qdtype, block_size, shape, zero_point_domain):
        if qdtype.kind is QKind.CODEBOOK:
            return f"PlainLayout stores integer and float8 codes, not {qdtype.name} (use its own layout)"
        return None

    def packed_specs(self, qdtype, block_size, shape, zero_point_domain):
        return {"qdata": PackedSpec(padded_shape(shape, block_size), (qdtype.storage_dtype,)),
                **scale_specs(shape, block_size, zero_point_domain)}

    def pack(self, parts: PlainParts, qdtype, block_size, zero_point_domain):
        qdata = pad_to(parts.qdata, padded_shape(parts.qdata.shape, block_size))
        return {"qdata": qdata, "scale": parts.scale, "zero_point": parts.zero_point}

    def unpack(self, aqt) -> PlainParts:
        qdata = aqt.qdata[tuple(slice(0, s) for s in aqt.logical_shape)]
        return PlainParts(qdata, aqt.scale, aqt.zero_point)

    def __repr__(self) -> str:
        return "PlainLayout()"

    @staticmethod
    def linear_paths() -> list[dict]:
        """What serves F.linear for each kind of plain weight (read by torchqkit.kernels.status())."""
        wo, wo_why = cpu_backend(_WEIGHT_ONLY_OP)
        da, da_why = cpu_backend(_DYNAMIC_INT8_OP)
        return [
            {"linear": "weight-only symmetric int codes in int8, per-row or group-wise",
             "path": f"{_WEIGHT_ONLY_OP} ({wo})", "why": wo_why},
            {"linear": "weight-only, other (zero point, uint8 storage, float8)", "path": "reference",
             "why": "dequantize + F.linear: no fused kernel for these yet"},
            {"linear": "int8 dynamic act (per token, symmetric / asymmetric) x per-row symmetric int8 weight",
             "path": f"{_DYNAMIC_INT8_OP} ({da})", "why": da_why},
            {"linear": "int8 static per-tensor act (calibrated scale) x per-row symmetric int8 weight",
             "path": "aten._int_mm", "why": f"{_DYNAMIC_INT8_OP} computes per-token scales inside; a static scale "
             "is applied in Python (quantize x, torch._int_mm, rescale): exact, one extra pass over x"},
            {"linear": "int8 dynamic act with symmetric_no_clipping_err mapping x per-row symmetric weight",
             "path": "aten._int_mm", "why": "the custom op implements the symmetric and asymmetric mappings only"},
            {"linear": "int8 dynamic act x group-wise or zero-point int weight", "path": "reference",
             "why": "no kernel applies per-group scales inside K; fake-quantized activation + dequantized weight"},
            {"linear": "float8 act x per-tensor / per-row float8 weight", "path": "aten._scaled_mm",
             "why": "torch's CPU _scaled_mm is itself a slow reference implementation"},
            {"linear": "any, KernelPreference.REFERENCE, or activations not float32/bfloat16/float16", "path": "reference",
             "why": "chosen explicitly / no kernel for that activation dtype"},
        ]


# ------------------------------------------------------------------------------------------------
# linear
# ------------------------------------------------------------------------------------------------

_WEIGHT_ONLY_OP = "torchqkit::linear_int8wo_plain"
_DYNAMIC_INT8_OP = "torchqkit::linear_int8da_int8_plain"
_KERNEL_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _symmetric_int8_codes(w) -> bool:
    return (w.qdtype.kind is QKind.INT and w.qdtype.signed and w.qdata.dtype == torch.int8
            and w.zero_point_domain is ZeroPointDomain.NONE and w.block_size[0] == 1)


def linear_path(w) -> str:
    """Name of the path that serves ``F.linear`` for this weight (also reported by kernels.status())."""
    spec = w.act_quant
    if w.kernel_preference is KernelPreference.REFERENCE:
        return "reference"
    if spec is None:
        return _WEIGHT_ONLY_OP if _symmetric_int8_codes(w) else "reference"
    per_row = w.block_size == (1, w.logical_shape[1])
    if (spec.qdtype.kind is QKind.INT and w.qdtype.kind is QKind.INT and w.qdtype.signed
            and w.zero_point_domain is ZeroPointDomain.NONE and per_row):
        if (_symmetric_int8_codes(w) and spec.static_scale is None
                and spec.mapping in (MappingType.SYMMETRIC, MappingType.ASYMMETRIC)):
            return _DYNAMIC_INT8_OP
        return "aten._int_mm"
    if scaled_mm_applies(w):
        return "aten._scaled_mm"
    return "reference"


@PlainLayout.ops.implements(F.linear)
def _linear(w, x, bias):
    path = linear_path(w)
    if path in (_WEIGHT_ONLY_OP, _DYNAMIC_INT8_OP) and x.dtype not in _KERNEL_ACT_DTYPES:
        path = "reference"
    if path == _WEIGHT_ONLY_OP:  # block_size[0] == 1: rows are never padded, K may be
        return torch.ops.torchqkit.linear_int8wo_plain(pad_features(x, w.qdata.shape[1]), w.qdata, w.scale, bias)
    if path == _DYNAMIC_INT8_OP:
        symmetric = w.act_quant.mapping is MappingType.SYMMETRIC
        return torch.ops.torchqkit.linear_int8da_int8_plain(x, w.qdata, w.scale, bias, symmetric)
    if path == "aten._int_mm":
        return _int8_dynamic_linear(w, x, bias)
    if path == "aten._scaled_mm":
        return scaled_mm_linear(w, x, bias)
    return reference_linear(w, x, bias)


def _int8_dynamic_linear(w, x, bias):
    n = w.logical_shape[0]
    qa = w.act_quant.quantize(flatten_tokens(x))
    acc = torch._int_mm(qa.qdata, w.qdata.t())  # (M, N) int32, exact
    if qa.zero_point is not None:
        # x ~ (qx - zx) sx, so sum_k (qx - zx) qw = acc - zx * sum_k qw
        acc = acc - qa.zero_point.to(torch.int32) * w.qdata.sum(dim=1, dtype=torch.int32)
    out = acc.to(torch.float32) * qa.scale * w.scale.reshape(1, n).to(torch.float32)
    out = out.to(x.dtype).reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias


# ------------------------------------------------------------------------------------------------
# slice / narrow (tensor-parallel and vLLM loaders), at block boundaries
# ------------------------------------------------------------------------------------------------

@PlainLayout.ops.implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    self, dim, start, end, step = fill_defaults(args, 5, [0, None, None, 1])
    cut = block_slice(self, dim, start, end, step)
    tensors = {name: (None if t is None else t.narrow(cut.dim, *(cut.stored if name == "qdata" else cut.blocks)))
               for name, t in self.inner_tensors().items()}
    out = self.with_changes(tensors, logical_shape=cut.logical_shape, block_size=cut.block_size)
    return return_and_correct_aliasing(func, args, kwargs, out)
