"""torchqkit::linear_fp8wo(x, qdata, scale, bias): weight-only float8.

Float8Layout bytes: qdata (N, K) float8_e4m3fn / e5m2; scale (N/bn, K/bk) float32 (per tensor, row, block).
Backends: csrc/cpu/linear_lowbit.cpp, csrc/cuda/fp8_gemv.cu, kernels/triton.
"""
from __future__ import annotations

from .common import define_qdata_scale_op, expand_blocks

__all__ = ["fp8_weight", "linear_fp8wo_ref"]


def fp8_weight(qdata, scale, k=None):
    """Float8 codes and block scales -> the float32 (N, K) weight."""
    return qdata.float() * expand_blocks(scale, qdata.shape)


OP = define_qdata_scale_op("torchqkit::linear_fp8wo", fp8_weight)
linear_fp8wo_ref = OP.reference
