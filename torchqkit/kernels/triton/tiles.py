"""The tile arithmetic every dequantize-in-the-loop GEMM shares: program -> (rows, columns, k offsets), the
masked activation tile, and the epilogue (bias, cast, masked store). Only the weight tile differs per format."""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tile_offsets", "load_x_tile", "store_output"]


@triton.jit
def tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows rm, columns rn of this program's output tile (grid: (M tiles, N tiles)) and the k offsets rk."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, tl.arange(0, BLOCK_K)


@triton.jit
def load_x_tile(x_ptr, rm, kk, stride_xm, M, K):
    """(BLOCK_M, BLOCK_K) activations, zero outside (M, K)."""
    return tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS: tl.constexpr):
    """acc (+ bias[n]) cast to the output dtype, stored where (rm, rn) is inside (M, N)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])
