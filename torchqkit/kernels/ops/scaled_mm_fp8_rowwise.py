"""torchqkit::scaled_mm_fp8_rowwise(a, b, scale_a, scale_b, bias, out_dtype): float8 x float8 with row scales.

a (M, K) and b (N, K) float8 codes, scale_a (M, 1), scale_b (N, 1) float32: a @ b.T * scale_a * scale_b.T (+ bias),
in out_dtype. Serves float8-activation routes under KernelPreference.TRITON (AUTO takes torch._scaled_mm).
Backends: kernels/triton.
"""
from __future__ import annotations

import torch

from ..registry import define_linear_op
from .common import check_features

__all__ = ["scaled_mm_fp8_rowwise_ref"]


def scaled_mm_fp8_rowwise_ref(a, b, scale_a, scale_b, bias=None, out_dtype=torch.float32):
    out = (a.float() @ b.float().t()) * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)


define_linear_op(
    "torchqkit::scaled_mm_fp8_rowwise",
    "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, ScalarType out_dtype=float) -> Tensor",
    reference=scaled_mm_fp8_rowwise_ref,
    out_features=lambda a, b, *_: b.shape[0],
    out_dtype=lambda a, b, scale_a, scale_b, bias=None, out_dtype=torch.float32: out_dtype,
    check=lambda a, b, *_: check_features(a, b.shape[1], "scaled_mm_fp8_rowwise"))
