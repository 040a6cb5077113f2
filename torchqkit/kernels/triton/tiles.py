"""The tile arithmetic every dequantize-in-the-loop GEMM shares: program -> (rows, columns, k offsets), the K loop,
the masked activation tile, and the epilogue (bias, cast, masked store). Only the weight tile differs per format.

Note [Tile loaders]
~~~~~~~~~~~~~~~~~~~
``dequant_matmul`` runs the K loop once for every format. What differs is passed in as ``tl.constexpr``
``@triton.jit`` functions (Triton specializes the caller on them, as ``tl.reduce`` does on its combine function),
each with the same signature:

    loader(args, FORMAT: tl.constexpr, offsets, kk, limit, K) -> float tile

- ``args``: a tuple of that format's pointers, sizes and strides (the kernel's own arguments, forwarded as is);
- ``FORMAT``: a compile-time switch the loader may read (float8 flavour, double quantization, MX element);
- ``offsets`` are the tile's rows (activations, (BLOCK_M, BLOCK_K) tile) or columns (weights, (BLOCK_K, BLOCK_N)
  tile), ``kk`` the k offsets of this step, ``limit`` M or N: the tile is zero outside (limit, K).

The loaders are module-level jit functions, never Python closures, so the kernels compile for a real GPU
exactly as they run in the interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tile_offsets", "load_x_tile", "activation_tile", "dequant_matmul", "store_output"]


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
def activation_tile(args, FORMAT: tl.constexpr, rm, kk, M, K):
    """The float activations' loader (Note [Tile loaders]): args = (x_ptr, stride_xm); FORMAT unused."""
    return load_x_tile(args[0], rm, kk, args[1], M, K)


@triton.jit
def dequant_matmul(x_tile: tl.constexpr, x_args, X_FORMAT: tl.constexpr,
                   w_tile: tl.constexpr, w_args, W_FORMAT: tl.constexpr,
                   M, N, K, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's (BLOCK_M, BLOCK_N) float32 tile of x @ w: per BLOCK_K step, load the x tile, decode the
    weight tile in registers, one ``tl.dot`` in the x tile's dtype. Returns (rm, rn, acc) for the epilogue."""
    rm, rn, rk = tile_offsets(BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = x_tile(x_args, X_FORMAT, rm, kk, M, K)
        w = w_tile(w_args, W_FORMAT, rn, kk, N, K)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    return rm, rn, acc


@triton.jit
def store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS: tl.constexpr):
    """acc (+ bias[n]) cast to the output dtype, stored where (rm, rn) is inside (M, N)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])
