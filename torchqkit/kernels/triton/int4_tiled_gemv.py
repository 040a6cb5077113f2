"""int4 tensor-core-tiled weight x activations for decode (M of a few tokens): split-K GEMV.

One program per (column block, K slice): it dequantizes its (BLOCK_K, BLOCK_N) weight tiles with the
same tile decoder as the GEMM (decode.int4_tiled_tile) and reduces with a multiply + sum
instead of tl.dot, which would pad M to 16. SPLIT_K slices write fp32 partials (SPLIT_K, M, N) that the
launcher sums: more programs in flight when N alone can't fill the GPU, deterministic (no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import int4_tiled_tile
from .registration import gemv_configs, gpu_family, traceable


_CONFIGS = gemv_configs(gpu_family(), k_multiple=32)


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K"])
@triton.jit
def _int4_tiled_gemv_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # int32 tiles [N8 / 8][NUM_CHUNKS][32][WORDS], contiguous
    sz_ptr,       # [Kt / GROUP][N8][2] scale and zero point, contiguous
    part_ptr,     # (MAX_SPLIT, M, N) float32 partial sums, zero-filled; slice s written by K slice s
    # sizes
    M, N, K, GROUP, NUM_CHUNKS, WORDS, N8,
    # strides, in elements
    stride_xm,
    # meta
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # ---- one output row at a time: decode is cheap next to the weight bytes, which stay in cache ----
    for m in range(0, M):
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + m * stride_xm + kk, mask=kk < k_end, other=0.0).to(tl.float32)
            w = int4_tiled_tile(q_ptr, sz_ptr, rn, kk, N, k_end, GROUP, NUM_CHUNKS, WORDS, N8)
            acc += tl.sum(x[:, None] * w, axis=0)
        tl.store(part_ptr + (pid_k * M + m) * N + rn, acc, mask=rn < N)


MAX_SPLIT = max(c.kwargs["SPLIT_K"] for c in _CONFIGS)  # the partial buffer fits whichever config autotuning picks


def launch(x2, qdata, scale_and_zero, group_size, out_features, bias=None):
    """(M, K) contiguous x2 -> (M, N) in x2.dtype; constraints are checked by the caller (int4_tiled_gemm)."""
    m, k = x2.shape
    n = out_features
    parts = torch.zeros(MAX_SPLIT, m, n, dtype=torch.float32, device=x2.device)
    q, sz = qdata.contiguous(), scale_and_zero.contiguous()
    if m and n:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
        traceable(_int4_tiled_gemv_kernel)[grid](
            x2, q, sz, parts, m, n, k, group_size, q.shape[1], q.shape[3], q.shape[0] * 8, x2.stride(0))
    out = parts.sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(x2.dtype)
