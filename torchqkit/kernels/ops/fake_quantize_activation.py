"""torchqkit::fake_quantize_activation: an activation quantized to float8, MXFP8 or NVFP4 and dequantized again.

    fake_quantize_activation(x, qdtype, group_size, per_tensor, static_scale, offs) -> Tensor (x's shape and dtype)

x is (..., K), its leading dims the tokens as F.linear takes them ((M, K) with group ends).

What the float8 / MXFP8 / NVFP4 activation configs hand a weight-only kernel (Note [Activations fake-quantized
before a weight-only kernel], layouts/routes.py). The reference is core's quantize_activation then
dequantize_activation, what ``ActivationQuantSpec.fake_quantize`` computes; the C++ CPU kernel
(csrc/cpu/fake_quantize_activation.cpp, Note [Fake-quantized activations in C++]) gives the same values bit for bit at
a hundredth of the cost for one token. ``offs`` (group ends, a stack of experts) takes a per-tensor scale, or NVFP4's
tensor-wide one, over each group's rows as that expert's own linear does; rows past the last end are returned
unchanged.
"""
from __future__ import annotations

import torch

from ...core.activation_quant import dequantize_activation, quantize_activation
from ...core.granularity import PerGroup, PerTensor, PerToken
from ...core.primitives import MappingType
from ...core.qdtype import QKind, fp4_e2m1, qdtype_from_name
from ..registry import define_op

__all__ = ["fake_quantize_activation", "fake_quantize_activation_ref", "op_arguments", "takes"]


def takes(spec) -> bool:
    """Whether the op computes ``spec``'s fake quantization: float8 (per token, per tensor, static, MXFP8) and
    NVFP4; integer activations go through the integer kernels' own quantizer."""
    return spec.qdtype.kind is QKind.FLOAT8 or spec.qdtype is fp4_e2m1


def op_arguments(spec) -> tuple[str, int, bool, float | None]:
    """(qdtype, group_size, per_tensor, static_scale): the op's arguments for an ActivationQuantSpec it takes."""
    return spec.qdtype.name, spec.group_size or 0, spec.per_tensor, spec.static_scale


def _fake_quantize(x: torch.Tensor, qdtype: str, group_size: int, per_tensor: bool,
                   static_scale: float | None) -> torch.Tensor:
    q = qdtype_from_name(qdtype)
    granularity = PerGroup(group_size) if group_size else PerTensor() if per_tensor else PerToken()
    x2 = x.reshape(-1, x.shape[-1])
    codes, scale, zp = quantize_activation(x2, q, granularity, MappingType.SYMMETRIC, static_scale)
    return dequantize_activation(codes, q, granularity, static_scale, scale, zp, x.dtype).reshape(x.shape)


def fake_quantize_activation_ref(x: torch.Tensor, qdtype: str, group_size: int, per_tensor: bool,
                                 static_scale: float | None = None, offs: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) quantized and dequantized; with offs (x: (M, K)), over each group of rows
    ``[offs[g - 1], offs[g])``."""
    if offs is None:
        return _fake_quantize(x, qdtype, group_size, per_tensor, static_scale)
    out, start = x.clone(), 0
    for end in offs.tolist():  # one host sync for all groups
        end = min(end, x.shape[0])
        if end > start:
            out[start:end] = _fake_quantize(x[start:end], qdtype, group_size, per_tensor, static_scale)
        start = max(start, end)
    return out


def _fake(x, qdtype, group_size, per_tensor, static_scale=None, offs=None):
    torch._check(x.dim() >= 1 and (offs is None or x.dim() == 2),
                 lambda: f"fake_quantize_activation: x must be (..., features), (tokens, features) with group ends, "
                         f"got {x.shape}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


define_op("torchqkit::fake_quantize_activation",
          "(Tensor x, str qdtype, int group_size, bool per_tensor, float? static_scale=None, Tensor? offs=None) "
          "-> Tensor", reference=fake_quantize_activation_ref, fake=_fake)


def fake_quantize_activation(x: torch.Tensor, spec, offs: torch.Tensor | None = None) -> torch.Tensor:
    """``spec.fake_quantize`` of x (..., K) through torchqkit::fake_quantize_activation (module docstring)."""
    return torch.ops.torchqkit.fake_quantize_activation(x, *op_arguments(spec), offs)
