"""torchqkit::linear_int8da_int8_plain(x, qdata, scale, bias, act_symmetric): int8 dynamic activation x int8 weight.

Each row of x is quantized per token inside the op (symmetric, or asymmetric with an integer zero point; the
oracle's choose_qparams / quantize_affine numerics), then an exact integer matmul, then ``* act_scale * scale +
bias``. qdata: (N, K) int8 symmetric per-channel codes; scale: (N, 1). Returns (..., N) in x.dtype.
Backends: csrc/cpu/linear_int8.cpp (VNNI / AVX2).
"""
from __future__ import annotations

from ..registry import define_linear_op
from .common import check_features, int8_activation_rows
from .linear_int8wo_plain import int8_plain_weight

__all__ = ["linear_int8da_int8_plain_ref"]


def linear_int8da_int8_plain_ref(x, qdata, scale, bias=None, act_symmetric=True):
    k = qdata.shape[1]
    x2 = x.reshape(-1, k).float()
    qa, a_scale = int8_activation_rows(x2, act_symmetric)
    # Integer products summed in float32: exact while partial sums stay below 2**24, then ~1e-7 relative.
    out = (qa @ qdata.float().t()) * (a_scale * scale.reshape(1, -1).float())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qdata.shape[0])


define_linear_op(
    "torchqkit::linear_int8da_int8_plain",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None, bool act_symmetric=True) -> Tensor",
    reference=linear_int8da_int8_plain_ref, weight=int8_plain_weight,
    out_features=lambda x, qdata, *_: qdata.shape[0],
    check=lambda x, qdata, *_: check_features(x, qdata.shape[1], "linear_int8da_int8_plain"))
