"""torchqkit::linear_int4wo_tiled(x, qdata, scale_and_zero, group_size, out_features, bias).

TensorCoreTiledLayout bytes as stored: qdata int32 [N8/8][Kt/(16T)][32][T/2], scale_and_zero [Kt/g][N8][2];
w = (q - 8) * scale + zero. x: (..., K) with K = in_features <= Kt. Backends: csrc/cpu/linear_int4.cpp,
csrc/cuda/int4_tiled_mma.cu, kernels/triton (GEMM and split-K GEMV).
"""
from __future__ import annotations

import torch

from ..registry import define_weight_only_op

__all__ = ["int4_tiled_codes", "int4_tiled_weight", "linear_int4wo_tiled_ref"]


def int4_tiled_codes(qdata):
    """int32 [N8/8][Kt/(16T)][32][T/2] tiles -> (N8, Kt) codes; Note [Tensor-core tiled int4] (layouts)."""
    nc, nw = qdata.shape[1], qdata.shape[3]
    chunk = 32 * nw  # 16 T
    n = torch.arange(qdata.shape[0] * 8, device=qdata.device)
    k = torch.arange(nc * chunk, device=qdata.device)
    rem = k % chunk
    t, h, c, e = rem // 16, (rem % 16) // 8, (rem % 8) // 2, rem % 2
    word = qdata[(n // 8)[:, None], (k // chunk)[None, :], (4 * (n % 8))[:, None] + c[None, :], (t // 2)[None, :]]
    return (word.to(torch.int64) >> (4 * (4 * e + 2 * (t % 2) + h))[None, :]) & 0xF


def int4_tiled_weight(qdata, scale_and_zero, group_size, n, k):
    """The float32 (n, k) weight of TensorCoreTiledLayout bytes: w = (q - 8) * scale + zero."""
    q = int4_tiled_codes(qdata)[:n, :k].float()
    groups = -(-k // group_size)  # a partial last group (K not a multiple of g) has its own scale and zero
    sz = scale_and_zero[:groups, :n].float().repeat_interleave(group_size, 0)[:k]  # (K, N, 2)
    return (q - 8) * sz[..., 0].t() + sz[..., 1].t()


OP = define_weight_only_op(
    "torchqkit::linear_int4wo_tiled",
    "(Tensor x, Tensor qdata, Tensor scale_and_zero, int group_size, int out_features, Tensor? bias=None) -> Tensor",
    weight=int4_tiled_weight,
    out_features=lambda x, qdata, scale_and_zero, group_size, out_features, *_: out_features,
    check=lambda x, qdata, *_: torch._check(
        qdata.dim() == 4, lambda: f"linear_int4wo_tiled: qdata must be 4-d tiles, got {tuple(qdata.shape)}"))
linear_int4wo_tiled_ref = OP.reference
