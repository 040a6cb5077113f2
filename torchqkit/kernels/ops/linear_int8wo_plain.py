"""torchqkit::linear_int8wo_plain(x, qdata, scale, bias): weight-only int8 linear on PlainLayout bytes.

y = x @ (qdata * scale).T + bias. x: (..., K) float32 / bfloat16 / float16; qdata: (N, K) int8 codes (symmetric,
no zero point); scale: (N, G), G dividing K (G = 1: per channel, else group size K / G); bias: (N) or None.
Returns (..., N) in x.dtype; computed in float32. Backends: csrc/cpu/linear_int8.cpp, kernels/triton.
"""
from __future__ import annotations

import torch

from ...core.primitives import dequantize_affine
from ...core.qdtype import int8
from .common import define_qdata_scale_op

__all__ = ["int8_plain_weight", "linear_int8wo_plain_ref"]


def int8_plain_weight(qdata, scale, k=None):
    """(N, K) int8 codes and (N, G) scales -> the float32 (N, K) weight."""
    scale = scale.reshape(qdata.shape[0], -1)
    return dequantize_affine(qdata, int8, (1, qdata.shape[1] // scale.shape[1]), scale, output_dtype=torch.float32,
                             name="weight")


OP = define_qdata_scale_op("torchqkit::linear_int8wo_plain", int8_plain_weight)
linear_int8wo_plain_ref = OP.reference
