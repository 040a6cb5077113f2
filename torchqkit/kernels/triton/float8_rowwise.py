"""float8 row-wise scaled matmul: out = (a @ b.T) * scale_a[m] * scale_b[n] + bias, a (M, K) and b (N, K)
float8 codes (e4m3fn, e5m2, e4m3fnuz or e5m2fnuz, Float8Layout / PlainLayout bytes), scales float32 (M, 1) and
(N, 1).

Both operands are decoded from their bytes to fp16 (exact: every value of the four float8 formats is an fp16 value)
and multiplied by ``tl.dot`` with fp32 accumulation, so products are exact and only the summation order
differs from the reference. This also runs under the interpreter and on sm80, which has no fp8 MMA.
Serves ``torchqkit::scaled_mm_fp8_rowwise``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import FLOAT8_FORMATS, float8_to_f32
from .registration import gpu_family, launch_tiled, matmul_configs, register
from .tiles import dequant_matmul, store_output


@triton.jit
def float8_rows_tile(args, FMT: tl.constexpr, rm, kk, M, K):
    """(BLOCK_M, BLOCK_K) float16 values of a's float8 bytes (exact), zero outside (M, K); args = (a_ptr,)."""
    byte = tl.load(args[0] + rm[:, None] * K + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :], other=0)
    return float8_to_f32(byte.to(tl.int32), FMT).to(tl.float16)


@triton.jit
def float8_cols_tile(args, FMT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) values of b's float8 bytes, b (N, K) read transposed; args = (b_ptr,)."""
    byte = tl.load(args[0] + rn[None, :] * K + kk[:, None], mask=(kk < K)[:, None] & (rn < N)[None, :], other=0)
    return float8_to_f32(byte.to(tl.int32), FMT)


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K", "A_FMT", "B_FMT"])
@triton.jit
def _fp8_rowwise_kernel(
    # pointers
    a_ptr,        # (M, K) float8 bytes as uint8, contiguous
    b_ptr,        # (N, K) float8 bytes as uint8, contiguous
    sa_ptr,       # (M) float32 row scales of a
    sb_ptr,       # (N) float32 row scales of b
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N) in out_dtype, contiguous
    # sizes
    M, N, K,
    # meta
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # float16 operands: the backend's default dot precision (exact products, fp32 accumulation)
    rm, rn, acc = dequant_matmul(float8_rows_tile, (a_ptr,), A_FMT, float8_cols_tile, (b_ptr,), B_FMT,
                                 M, N, K, None, BLOCK_M, BLOCK_N, BLOCK_K)
    # ---- epilogue: row scales, bias ----
    acc *= tl.load(sa_ptr + rm, mask=rm < M, other=0.0)[:, None] * tl.load(sb_ptr + rn, mask=rn < N, other=0.0)[None, :]
    store_output(out_ptr, acc, rm, rn, N, M, N, bias_ptr, HAS_BIAS)


def scaled_mm_fp8_rowwise(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if (a.dtype not in FLOAT8_FORMATS or b.dtype not in FLOAT8_FORMATS or a.dim() != 2 or b.dim() != 2
            or a.shape[1] != b.shape[1]):
        raise ValueError(f"scaled_mm_fp8_rowwise (triton): a (M, K) and b (N, K) must be float8; got {a.dtype} "
                         f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    if scale_a.numel() != m or scale_b.numel() != n:
        raise ValueError(f"scaled_mm_fp8_rowwise (triton): row-wise scales need scale_a ({m}, 1) and scale_b ({n}, 1), "
                         f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    sa, sb = scale_a.float().reshape(m).contiguous(), scale_b.float().reshape(n).contiguous()
    launch_tiled(_fp8_rowwise_kernel, m, n,
                 a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8), sa, sb,
                 bias if bias is not None else sa, out, m, n, k,
                 A_FMT=FLOAT8_FORMATS[a.dtype], B_FMT=FLOAT8_FORMATS[b.dtype], HAS_BIAS=bias is not None)
    return out


OP = register("scaled_mm_fp8_rowwise", scaled_mm_fp8_rowwise)
