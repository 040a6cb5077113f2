"""torchqkit::linear_mxwo(x, qdata, scale, bias): weight-only MX (OCP microscaling) formats.

MXLayout bytes: qdata (N, K/2) uint8 MXFP4 (low nibble first) or (N, K) float8 MXFP8; scale (N, K/32) uint8 E8M0.
Backends: csrc/cpu/linear_lowbit_ops.cpp, kernels/triton.
"""
from __future__ import annotations

import torch

from .common import define_qdata_scale_op, e2m1_values

__all__ = ["mx_weight", "linear_mxwo_ref"]

MX_BLOCK = 32


def mx_weight(qdata, scale, k=None):
    """MXLayout bytes -> (N, K) float32 weight (e2m1 levels from core/qdtype)."""
    if qdata.dtype == torch.uint8:  # MXFP4, low nibble first
        elems = e2m1_values(qdata)
    else:
        elems = qdata.float()
    e = scale.to(torch.int32)
    x_scale = torch.where(e == 0, 0x00400000, e << 23).view(torch.float32)  # E8M0: 2^(e - 127)
    return elems * x_scale.repeat_interleave(MX_BLOCK, 1)


OP = define_qdata_scale_op("torchqkit::linear_mxwo", mx_weight,
                           in_features=lambda qdata, scale: MX_BLOCK * scale.shape[1])
linear_mxwo_ref = OP.reference
