"""The ``torch._scaled_mm`` linear shared by every layout that stores float8 codes as torch float8 tensors
(PlainLayout, Float8Layout): float8 activations x float8 weights with per-tensor or per-row scales.

The weight's ``qdata`` must be the (N, K) float8 codes and ``scale`` (1, 1) or (N, 1) float scales.
"""
from __future__ import annotations

import torch

from ..core.qdtype import QKind
from ..tensor.activation import KernelPreference
from ..tensor.reference import flatten_tokens

__all__ = ["scaled_mm_applies", "scaled_mm_linear"]


def scaled_mm_applies(w) -> bool:
    """True when ``F.linear(x, w)`` can run on ``torch._scaled_mm``: float8 activation quantization and a
    float8 weight with one scale per tensor or per row (``_scaled_mm`` has no scales inside K)."""
    spec = w.act_quant
    if spec is None or w.kernel_preference is KernelPreference.REFERENCE:
        return False
    per_row = w.block_size == (1, w.logical_shape[1])
    per_tensor = w.block_size == w.logical_shape
    return spec.qdtype.kind is QKind.FLOAT8 and w.qdtype.kind is QKind.FLOAT8 and (per_row or per_tensor)


def scaled_mm_linear(w, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n = w.logical_shape[0]
    x2 = flatten_tokens(x)
    qa = w.act_quant.quantize(x2)
    scale_a, scale_b = qa.scale.to(torch.float32), w.scale.reshape(1, -1).to(torch.float32)
    if scale_a.numel() != 1 or scale_b.numel() != 1:  # _scaled_mm wants both row-wise or both scalar
        scale_a, scale_b = scale_a.expand(x2.shape[0], 1).contiguous(), scale_b.expand(1, n).contiguous()
    else:
        scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
    out = torch._scaled_mm(qa.qdata, w.qdata.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    out = out.reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias
