"""torchqkit::linear_fp8wo(x, qdata, scale, bias): weight-only float8.

Float8Layout bytes: qdata (N, K) float8_e4m3fn / e5m2; scale (N/bn, K/bk) float32 (per tensor, row, block).
Backends: csrc/cpu/linear_lowbit.cpp, csrc/cuda/fp8_gemv.cu, kernels/triton.
"""
from __future__ import annotations

from ..registry import define_weight_only_op
from .common import check_features, expand_blocks

__all__ = ["fp8_weight", "linear_fp8wo_ref"]


def fp8_weight(qdata, scale, k=None):
    """Float8 codes and block scales -> the float32 (N, K) weight."""
    return qdata.float() * expand_blocks(scale, qdata.shape)


OP = define_weight_only_op(
    "torchqkit::linear_fp8wo", "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None) -> Tensor",
    weight=fp8_weight,
    out_features=lambda x, qdata, *_: qdata.shape[0],
    check=lambda x, qdata, *_: check_features(x, qdata.shape[1], "linear_fp8wo"))
linear_fp8wo_ref = OP.reference
