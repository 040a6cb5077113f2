"""torchqkit::linear_int4wo_tiled(x, qdata, scale_and_zero, group_size, out_features, bias).

TensorCoreTiledLayout bytes as stored: qdata int32 [N8/8][Kt/(16T)][32][T/2], scale_and_zero [Kt/g][N8][2];
w = (q - 8) * scale + zero. x: (..., K) with K = in_features <= Kt. Backends: csrc/cpu/linear_int4wo_tiled.cpp,
csrc/cuda/int4_tiled_mma.cu, kernels/triton (GEMM and split-K GEMV).
"""
from __future__ import annotations

import torch

from ..registry import define_weight_only_op

__all__ = ["int4_tiled_codes", "int4_tiled_weight", "linear_int4wo_tiled_ref"]


# Dims of the words as (i, j, r, c, w, e, u, h) -> of the codes (i, r, j, w, u, h, c, e), where n = 8 i + r and
# k = 16 T j + 16 (2 w + u) + 8 h + 2 c + e (Note [Tensor-core tiled int4] in layouts/tensor_core_tiled.py).
FROM_WORDS = (0, 2, 1, 4, 6, 7, 3, 5)


def int4_tiled_codes(qdata):
    """int32 [N8/8][Kt/(16T)][32][T/2] tiles -> (N8, Kt) uint8 codes: the one decoder of the tiled bytes (the
    layout's unpack and every reference use it)."""
    nt, nc, _, nw = qdata.shape
    word_bytes = qdata.contiguous().view(torch.uint8).reshape(nt, nc, 32, nw, 4)
    # Nibble p = byte p // 2, high if p odd. A broadcast shift rather than torch.stack of the two halves:
    # inductor lowers that stack to a separate cat that unpacks the whole weight, where a pointwise shift
    # fuses into the consumer (an embedding gather then decodes only the rows it reads).
    shifts = torch.arange(0, 8, 4, dtype=torch.uint8, device=qdata.device)
    nibbles = (word_bytes.unsqueeze(-1) >> shifts) & 0xF
    nibbles = nibbles.reshape(nt, nc, 8, 4, nw, 2, 2, 2).permute(FROM_WORDS)
    return nibbles.reshape(nt * 8, nc * 32 * nw)


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
