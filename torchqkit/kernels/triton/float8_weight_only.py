"""float8 weight-only linear (Float8Layout bytes): w = float(q) * scale[n // bn, k // bk], the scale per
tensor (1, 1), per row (N, 1) or per block (N / bn, K / bk). The bytes are read as uint8 and decoded from
bits (decode.py), so sm80, which has no float8 hardware, runs it too. Serves ``torchqkit::linear_fp8wo``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import FLOAT8_FORMATS, float8_to_f32
from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output


@triton.jit
def float8_scaled_tile(args, FMT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) weights float8(q[n, k]) * scale[n // SCALE_BN, k // SCALE_BK] (Note [Tile loaders]);
    args = (q_ptr, scale_ptr, SCALE_BN, SCALE_BK)."""
    q_ptr, scale_ptr, SCALE_BN, SCALE_BK = args[0], args[1], args[2], args[3]
    wmask = (kk < K)[:, None] & (rn < N)[None, :]
    byte = tl.load(q_ptr + rn[None, :] * K + kk[:, None], mask=wmask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + (rn // SCALE_BN)[None, :] * (K // SCALE_BK) + (kk // SCALE_BK)[:, None], mask=wmask,
                other=0.0)
    return float8_to_f32(byte, FMT) * s


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K", "FMT"])
@triton.jit
def _fp8_wo_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # (N, K) float8 bytes as uint8, contiguous
    scale_ptr,    # (N / SCALE_BN, K / SCALE_BK) float32, contiguous
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K, SCALE_BN, SCALE_BK,
    # strides, in elements
    stride_xm, stride_om,
    # meta
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0,
                                 float8_scaled_tile, (q_ptr, scale_ptr, SCALE_BN, SCALE_BK), FMT,
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def linear_fp8wo(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if qdata.dtype not in FLOAT8_FORMATS or qdata.dim() != 2:
        raise ValueError(f"linear_fp8wo (triton): qdata must be (N, K) float8 (e4m3fn, e5m2, e4m3fnuz, e5m2fnuz), got "
                         f"{qdata.dtype} {tuple(qdata.shape)}")
    n, k = qdata.shape
    if x.shape[-1] != k or scale.dim() != 2 or n % scale.shape[0] or k % scale.shape[1]:
        raise ValueError(f"linear_fp8wo (triton): x (..., {x.shape[-1]}) and scale {tuple(scale.shape)} must fit "
                         f"a ({n}, {k}) weight with scale (N / bn, K / bk)")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s = scale.float().contiguous()
    launch_tiled(_fp8_wo_kernel, m, n,
                 x2, qdata.contiguous().view(torch.uint8), s, bias if bias is not None else s, out,
                 m, n, k, n // s.shape[0], k // s.shape[1], x2.stride(0), out.stride(0),
                 FMT=FLOAT8_FORMATS[qdata.dtype], HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_fp8wo", linear_fp8wo)
