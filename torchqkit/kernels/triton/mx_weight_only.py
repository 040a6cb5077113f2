"""MXFP4 / MXFP8 weight-only linear (MXLayout bytes): w = element * 2^(scale_byte - 127), 32 elements per scale.

MXFP4: byte j of row n holds element 2 j in its LOW nibble (Note [MX bit layout]); MXFP8: one float8 byte
per element, read as uint8 and decoded from bits (decode.py), so no float8 loads are needed.
Serves ``torchqkit::linear_mxwo``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import e2m1_to_f32, e8m0_to_f32, float8_to_f32
from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output

ELEMENT_FP4, ELEMENT_E4M3, ELEMENT_E5M2 = 0, 1, 2
_ELEMENT = {torch.uint8: ELEMENT_FP4, torch.float8_e4m3fn: ELEMENT_E4M3, torch.float8_e5m2: ELEMENT_E5M2}


@triton.jit
def mx_tile(args, ELEMENT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) weights element * 2^(e - 127) (Note [Tile loaders]); args = (q_ptr, scale_ptr)."""
    q_ptr, scale_ptr = args[0], args[1]
    wmask = (kk < K)[:, None] & (rn < N)[None, :]
    # ---- elements ----
    if ELEMENT == 0:  # ELEMENT_FP4 (jit code reads only constexpr globals)
        byte = tl.load(q_ptr + rn[None, :] * (K // 2) + (kk // 2)[:, None], mask=wmask, other=0).to(tl.int32)
        elem = e2m1_to_f32(tl.where((kk % 2 == 0)[:, None], byte & 0xF, byte >> 4))
    else:
        byte = tl.load(q_ptr + rn[None, :] * K + kk[:, None], mask=wmask, other=0).to(tl.int32)
        elem = float8_to_f32(byte, ELEMENT - 1)  # ELEMENT_E4M3 / ELEMENT_E5M2 -> decode's F8_E4M3FN / F8_E5M2
    # ---- one E8M0 scale per 32 elements ----
    e = tl.load(scale_ptr + rn[None, :] * (K // 32) + (kk // 32)[:, None], mask=wmask, other=127).to(tl.int32)
    return elem * e8m0_to_f32(e)


@triton.autotune(configs=matmul_configs(gpu_family(), k_multiple=32), key=["M", "N", "K", "ELEMENT"])
@triton.jit
def _mx_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # MXFP4: (N, K / 2) uint8; MXFP8: (N, K) float8 bytes viewed as uint8; contiguous
    scale_ptr,    # (N, K / 32) uint8 E8M0, contiguous
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K,
    # strides, in elements
    stride_xm, stride_om,
    # meta
    ELEMENT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0, mx_tile, (q_ptr, scale_ptr), ELEMENT,
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def linear_mxwo(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    if qdata.dtype not in _ELEMENT or scale.dtype != torch.uint8:
        raise ValueError(f"linear_mxwo (triton): qdata must be uint8 (MXFP4) or float8 (MXFP8) and scale uint8 "
                         f"E8M0; got {qdata.dtype} and {scale.dtype}")
    n, k = qdata.shape[0], 32 * scale.shape[1]
    per_row = k // 2 if qdata.dtype == torch.uint8 else k
    if x.shape[-1] != k or qdata.shape[1] != per_row:
        raise ValueError(f"linear_mxwo (triton): x (..., {x.shape[-1]}), qdata {tuple(qdata.shape)} and scale "
                         f"{tuple(scale.shape)} disagree on K (32 elements per scale)")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    q = qdata.contiguous().view(torch.uint8)
    launch_tiled(_mx_kernel, m, n,
                 x2, q, scale.contiguous(), bias if bias is not None else scale, out,
                 m, n, k, x2.stride(0), out.stride(0),
                 ELEMENT=_ELEMENT[qdata.dtype], HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_mxwo", linear_mxwo)
