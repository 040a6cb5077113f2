"""FP6 weight-only linear (FP6Layout bytes): w = fp6_value(code) * scale, e3m2 (EBITS = 3) or e2m3 (EBITS = 2).

Code k of a row occupies bits [6k, 6k + 6) of the row's little-endian byte stream (Note [FP6 bit layout]): two byte
loads and a shift per weight; the value is built from its sign, exponent and mantissa fields (Note [FP6 codes]), no
table. One scale per row or per group of K / G. Serves ``torchqkit::linear_fp6wo``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output


@triton.jit
def fp6_to_f32(code, EBITS: tl.constexpr):
    """An FP6 code (int32 0..63): sign (bit 5) | EBITS exponent bits (bias 2^(EBITS-1) - 1) | 5 - EBITS mantissa."""
    MBITS: tl.constexpr = 5 - EBITS
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    exp = (code >> MBITS) & ((1 << EBITS) - 1)
    man = code & ((1 << MBITS) - 1)
    # normal: float32 with exponent exp - BIAS and the mantissa's top MBITS bits; subnormal: man * 2^(1 - BIAS - MBITS)
    normal = (((exp + 127 - BIAS) << 23) | (man << (23 - MBITS))).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * (0.0625 if EBITS == 3 else 0.125)  # 2^(1 - BIAS - MBITS): 2^-4 e3m2, 2^-3 e2m3
    mag = tl.where(exp == 0, sub, normal)
    return tl.where((code & 0x20) != 0, -mag, mag)


@triton.jit
def fp6_tile(args, EBITS: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) weights (Note [Tile loaders]); args = (q_ptr, scale_ptr, row_bytes, groups, group)."""
    q_ptr, scale_ptr, row_bytes, groups, group = args[0], args[1], args[2], args[3], args[4]
    wmask = (kk < K)[:, None] & (rn < N)[None, :]
    bit = kk * 6
    first = bit // 8
    row = q_ptr + rn[None, :] * row_bytes
    lo = tl.load(row + first[:, None], mask=wmask, other=0).to(tl.int32)
    hi = tl.load(row + (first + 1)[:, None], mask=wmask & ((first + 1) < row_bytes)[:, None], other=0).to(tl.int32)
    code = ((lo | (hi << 8)) >> (bit % 8)[:, None]) & 0x3F
    s = tl.load(scale_ptr + rn[None, :] * groups + (kk // group)[:, None], mask=wmask, other=0.0).to(tl.float32)
    return fp6_to_f32(code, EBITS) * s


@triton.autotune(configs=matmul_configs(gpu_family(), k_multiple=16), key=["M", "N", "K", "EBITS"])
@triton.jit
def _fp6_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # (N, ceil(K * 6 / 8)) uint8, contiguous
    scale_ptr,    # (N, G) float scales, contiguous
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K, ROW_BYTES, GROUPS, GROUP,
    # strides, in elements
    stride_xm, stride_om,
    # meta
    EBITS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0, fp6_tile,
                                 (q_ptr, scale_ptr, ROW_BYTES, GROUPS, GROUP), EBITS,
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def linear_fp6wo(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, ebits: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    n = qdata.shape[0]
    if ebits not in (2, 3) or qdata.dtype != torch.uint8 or qdata.shape[1] != -(-k * 6 // 8):
        raise ValueError(f"linear_fp6wo (triton): ebits must be 2 or 3 and qdata (N, ceil(K * 6 / 8)) uint8 for "
                         f"K = {k}; got ebits={ebits}, qdata {qdata.dtype} {tuple(qdata.shape)}")
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"linear_fp6wo (triton): scale must be (N, G) with G dividing K = {k}, got {tuple(scale.shape)}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s = scale.contiguous()
    launch_tiled(_fp6_kernel, m, n,
                 x2, qdata.contiguous(), s, bias if bias is not None else s, out,
                 m, n, k, qdata.shape[1], s.shape[1], k // s.shape[1], x2.stride(0), out.stride(0),
                 EBITS=ebits, HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_fp6wo", linear_fp6wo)
