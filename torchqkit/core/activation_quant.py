"""The oracle's activation quantization: a (M, K) activation quantized per token, per tensor, per group of features
or with a static scale, the way ``ActivationQuantSpec`` (tensor/activation.py: which combinations are accepted, Note
[Non-finite activation rows]) and the kernels' references compute it. Below the kernels, so that an op's reference
(kernels/ops) and the spec share one definition."""
from __future__ import annotations

import torch

from .granularity import Granularity, PerGroup, PerTensor
from .primitives import (MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine,
                         quantize_affine)
from .qdtype import QDType, QKind, fp4_e2m1

__all__ = ["activation_group_size", "activation_per_tensor", "activation_scale_rounding", "activation_block_size",
           "quantize_activation", "dequantize_activation"]


def activation_group_size(granularity: Granularity) -> int | None:
    """Features per scale within a token (PerGroup), or None: one scale per token or per tensor."""
    return granularity.group_size if isinstance(granularity, PerGroup) else None


def activation_per_tensor(granularity: Granularity, static_scale: float | None) -> bool:
    return isinstance(granularity, PerTensor) or static_scale is not None


def activation_scale_rounding(qdtype: QDType, granularity: Granularity) -> str | None:
    """The oracle's scale rounding: E8M0 for MXFP8 (float8 per group), float8 for NVFP4, None otherwise."""
    if qdtype is fp4_e2m1:
        return "float8_e4m3"
    grouped = activation_group_size(granularity) is not None
    return "power_of_two" if qdtype.kind is QKind.FLOAT8 and grouped else None


def activation_block_size(shape, qdtype: QDType, granularity: Granularity,
                          static_scale: float | None) -> tuple[int, int]:
    """The oracle's block size for a (M, K) activation: the whole tensor, one row per token (a static int8 scale is
    carried per row too), or a group of one token's features."""
    group = activation_group_size(granularity)
    if group is not None:
        return (1, group)
    per_tensor = activation_per_tensor(granularity, static_scale)
    per_row = not per_tensor or (static_scale is not None and qdtype.kind is QKind.INT)
    return (1, shape[1]) if per_row else (shape[0], shape[1])


def quantize_activation(x2d: torch.Tensor, qdtype: QDType, granularity: Granularity, mapping: MappingType,
                        static_scale: float | None):
    """(codes, scale, zero point or None) of a (M, K) activation. Non-finite rows stay non-finite and touch no other
    row: a dynamic per-tensor scale (and NVFP4's scale of the block scales) is taken over the finite values, and a
    row with a NaN / Inf gets NaN codes (float8) or a NaN scale (the others)."""
    block = activation_block_size(x2d.shape, qdtype, granularity, static_scale)
    finite = torch.isfinite(x2d)
    row_ok = finite.all(dim=-1, keepdim=True)
    if static_scale is not None:
        # int8 scales go per row (the same value in each) so a non-finite row gets its own NaN scale
        rows = x2d.shape[0] if qdtype.kind is QKind.INT else 1
        scale = torch.full((rows, 1), static_scale, dtype=torch.float32, device=x2d.device)
        zp = None
    else:
        zpd = ZeroPointDomain.INT if mapping is MappingType.ASYMMETRIC else ZeroPointDomain.NONE
        # NVFP4's per-call power-of-two scale spans every row: taken over the finite values only
        per_tensor = activation_per_tensor(granularity, static_scale)
        src = torch.where(finite, x2d, 0) if per_tensor or qdtype is fp4_e2m1 else x2d
        scale, zp = choose_qparams_affine(src, qdtype, block, mapping=mapping, zero_point_domain=zpd,
                                          scale_dtype=torch.float32,
                                          scale_rounding=activation_scale_rounding(qdtype, granularity),
                                          check_finite=False, name="activation")
    if qdtype.kind is QKind.FLOAT8:
        x2d = torch.where(row_ok, x2d, float("nan"))  # NaN codes: float8 has them
    else:
        scale = torch.where(row_ok, scale, float("nan"))  # int8 is per token: the row's own scale
    q = quantize_affine(x2d, qdtype, block, scale, zp, check_finite=False, name="activation")
    return q, scale, zp


def dequantize_activation(q: torch.Tensor, qdtype: QDType, granularity: Granularity, static_scale: float | None,
                          scale: torch.Tensor, zp: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    block = activation_block_size(q.shape, qdtype, granularity, static_scale)
    return dequantize_affine(q, qdtype, block, scale, zp, output_dtype=dtype, name="activation")
