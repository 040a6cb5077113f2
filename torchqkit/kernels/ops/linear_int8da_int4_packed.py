"""torchqkit::linear_int8da_int4_packed(x, qdata, scale, zero_point, bias, act_symmetric, act_group_size, act_bits).

int8 dynamic activation (quantized inside the op like linear_int8da_int8_plain: one scale per token, or with
act_group_size = the weight's group size one symmetric scale per token and group, llama.cpp's Q8_1 way; with
act_bits = 4 the same on int4 codes -8..7, W4A4) x int4
PackedIntxLayout bytes: qdata (N, ceil(K / 2)) uint8, code k in byte k // 2, low nibble first, stored as u = q + 8;
scale (N, G) group-wise (G = K / group_size) or per channel (G = 1); zero_point None, integer codes shaped like
scale (w = (q - zero_point) * scale) or floats shaped like scale (w = q * scale + zero_point: GGUF's Q4_1).
Returns (..., N) in x.dtype. Backends: csrc/cpu/linear_int8da_int4_packed.cpp (VNNI / AVX2).
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
    s = scale.float().repeat_interleave(g, 1)
    if zero_point is not None and zero_point.dtype.is_floating_point:
        return (u - 8.0) * s + zero_point.to(scale.dtype).float().repeat_interleave(g, 1)
    c = 8.0 if zero_point is None else 8.0 + zero_point.float().repeat_interleave(g, 1)
    return (u - c) * s


def linear_int8da_int4_packed_ref(x, qdata, scale, zero_point, bias=None, act_symmetric=True, act_group_size=0,
                                  act_bits=8):
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    w = int4_packed_weight(qdata, scale, zero_point, k)
    if act_group_size:
        qa, a_scale = int8_activation_rows(x2, True, act_group_size, act_bits)  # (M, K), (M, G)
        g = act_group_size
        parts = torch.einsum("mgk,ngk->mgn", qa.reshape(-1, k // g, g), w.reshape(-1, k // g, g))
        out = (parts * a_scale.unsqueeze(-1)).sum(1)
    else:
        qa, a_scale = int8_activation_rows(x2, act_symmetric, bits=act_bits)
        out = (qa @ w.t()) * a_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qdata.shape[0])


def _check(x, qdata, *_):
    torch._check(qdata.dim() == 2 and qdata.shape[1] == (x.shape[-1] + 1) // 2,
                 lambda: f"linear_int8da_int4_packed: qdata must be (N, ceil(K / 2)) for K = {x.shape[-1]}, "
                         f"got {tuple(qdata.shape)}")


define_linear_op(
    "torchqkit::linear_int8da_int4_packed",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? zero_point, Tensor? bias=None, bool act_symmetric=True, "
    "int act_group_size=0, int act_bits=8) -> Tensor",
    reference=linear_int8da_int4_packed_ref, weight=int4_packed_weight,
    out_features=lambda x, qdata, *_: qdata.shape[0], check=_check)
