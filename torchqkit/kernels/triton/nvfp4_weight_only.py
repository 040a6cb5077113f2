"""NVFP4 weight-only linear (NVFP4Layout bytes): w = e2m1 * (float8 e4m3 scale / global scale), 16 elements per scale.

Byte j of row n holds element 2 j in its LOW nibble (Note [NVFP4 bit layout]); the scale bytes are read as uint8 and
decoded from bits (decode.py); the block scale is E / G, the quotient the reference computes. Serves
``torchqkit::linear_nvfp4wo``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import e2m1_to_f32, e4m3fn_to_f32
from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output


@triton.jit
def nvfp4_tile(args, UNUSED: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) weights e2m1 * (E / G) (Note [Tile loaders]); args = (q_ptr, scale_ptr, global_ptr)."""
    q_ptr, scale_ptr, global_ptr = args[0], args[1], args[2]
    wmask = (kk < K)[:, None] & (rn < N)[None, :]
    byte = tl.load(q_ptr + rn[None, :] * (K // 2) + (kk // 2)[:, None], mask=wmask, other=0).to(tl.int32)
    elem = e2m1_to_f32(tl.where((kk % 2 == 0)[:, None], byte & 0xF, byte >> 4))
    e = tl.load(scale_ptr + rn[None, :] * (K // 16) + (kk // 16)[:, None], mask=wmask, other=0x38).to(tl.int32)
    return elem * (e4m3fn_to_f32(e) / tl.load(global_ptr))


@triton.autotune(configs=matmul_configs(gpu_family(), k_multiple=16), key=["M", "N", "K"])
@triton.jit
def _nvfp4_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # (N, K / 2) uint8, contiguous
    scale_ptr,    # (N, K / 16) float8_e4m3fn bytes viewed as uint8, contiguous
    global_ptr,   # (1,) float32: the global scale G (a divisor)
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K,
    # strides, in elements
    stride_xm, stride_om,
    # meta
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0, nvfp4_tile, (q_ptr, scale_ptr, global_ptr),
                                 0, M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def linear_nvfp4wo(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    if qdata.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or global_scale.numel() != 1:
        raise ValueError(f"linear_nvfp4wo (triton): qdata must be uint8, scale float8_e4m3fn and global_scale one "
                         f"float; got {qdata.dtype}, {scale.dtype} and {tuple(global_scale.shape)}")
    n, k = qdata.shape[0], 16 * scale.shape[1]
    if x.shape[-1] != k or qdata.shape[1] != k // 2:
        raise ValueError(f"linear_nvfp4wo (triton): x (..., {x.shape[-1]}), qdata {tuple(qdata.shape)} and scale "
                         f"{tuple(scale.shape)} disagree on K (16 elements per scale)")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    g = global_scale.reshape(1).float().contiguous()
    launch_tiled(_nvfp4_kernel, m, n,
                 x2, qdata.contiguous(), scale.contiguous().view(torch.uint8), g, bias if bias is not None else g, out,
                 m, n, k, x2.stride(0), out.stride(0),
                 HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_nvfp4wo", linear_nvfp4wo)
