"""torchqkit::linear_int8da_int4_packed(x, qdata, scale, zero_point, bias, act_symmetric).

int8 dynamic activation (per token, quantized inside the op like linear_int8da_int8_plain) x int4 PackedIntxLayout
bytes: qdata (N, ceil(K / 2)) uint8, code k in byte k // 2, low nibble first, stored as u = q + 8; scale (N, G)
group-wise (G = K / group_size) or per channel (G = 1); zero_point None or integer codes shaped like scale:
w = (q - zero_point) * scale. Returns (..., N) in x.dtype. Backends: csrc/cpu/linear_int4.cpp (VNNI / AVX2).
"""
from __future__ import annotations

import torch

from ..registry import define_linear_op
from .common import int8_activation_rows, split_nibbles

__all__ = ["int4_packed_weight", "linear_int8da_int4_packed_ref"]


def int4_packed_weight(qdata, scale, zero_point, k):
    """PackedIntxLayout int4 bytes -> the float32 (N, K) weight."""
    u = split_nibbles(qdata, high_first=False)[:, :k].float()
    g = k // scale.shape[1]
    c = 8.0 if zero_point is None else 8.0 + zero_point.float().repeat_interleave(g, 1)
    return (u - c) * scale.float().repeat_interleave(g, 1)


def linear_int8da_int4_packed_ref(x, qdata, scale, zero_point, bias=None, act_symmetric=True):
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    qa, a_scale = int8_activation_rows(x2, act_symmetric)
    out = (qa @ int4_packed_weight(qdata, scale, zero_point, k).t()) * a_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qdata.shape[0])


def _check(x, qdata, *_):
    torch._check(qdata.dim() == 2 and qdata.shape[1] == (x.shape[-1] + 1) // 2,
                 lambda: f"linear_int8da_int4_packed: qdata must be (N, ceil(K / 2)) for K = {x.shape[-1]}, "
                         f"got {tuple(qdata.shape)}")


define_linear_op(
    "torchqkit::linear_int8da_int4_packed",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? zero_point, Tensor? bias=None, bool act_symmetric=True) -> Tensor",
    reference=linear_int8da_int4_packed_ref, weight=int4_packed_weight,
    out_features=lambda x, qdata, *_: qdata.shape[0], check=_check)
