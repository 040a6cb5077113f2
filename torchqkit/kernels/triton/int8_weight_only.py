"""int8 weight-only linear (PlainLayout bytes): y = x @ (qdata * scale[n, k // g]).T + bias.

The weight tile is dequantized in registers inside the K loop (fp32, then the activation dtype for
``tl.dot``), so the int8 bytes are the only weight traffic. Serves ``torchqkit::linear_int8wo_plain``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output


@triton.jit
def int8_plain_tile(args, FORMAT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) weights q * scale[n, k // GROUP] (Note [Tile loaders]); args = (w_ptr, scale_ptr,
    stride_wn, stride_sn, GROUP)."""
    w_ptr, scale_ptr, stride_wn, stride_sn, GROUP = args[0], args[1], args[2], args[3], args[4]
    wmask = (kk < K)[:, None] & (rn < N)[None, :]
    q = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=wmask, other=0)
    s = tl.load(scale_ptr + rn[None, :] * stride_sn + (kk // GROUP)[:, None], mask=wmask, other=0.0)
    return q.to(tl.float32) * s.to(tl.float32)


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K"])
@triton.jit
def _int8_wo_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm, unit column stride
    w_ptr,        # (N, K) int8 codes, row stride stride_wn
    scale_ptr,    # (N, G) float scales, row stride stride_sn; group size GROUP = K // G
    bias_ptr,     # (N) or a dummy pointer when HAS_BIAS is False
    out_ptr,      # (M, N) in the activation dtype, row stride stride_om
    # sizes
    M, N, K, GROUP,
    # strides, in elements
    stride_xm, stride_wn, stride_sn, stride_om,
    # meta
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0,
                                 int8_plain_tile, (w_ptr, scale_ptr, stride_wn, stride_sn, GROUP), 0,
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def linear_int8wo_plain(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    # (1) constraints
    n, k = qdata.shape
    if qdata.dtype != torch.int8 or x.shape[-1] != k:
        raise ValueError(f"linear_int8wo_plain (triton): need int8 qdata (N, K) and x (..., K); got {qdata.dtype} "
                         f"{tuple(qdata.shape)} and x {tuple(x.shape)}")
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"linear_int8wo_plain (triton): scale must be (N, G) with G dividing K = {k}, "
                         f"got {tuple(scale.shape)}")
    x2 = x.reshape(-1, k).contiguous()
    w, s = qdata.contiguous(), scale.contiguous()
    # (2) output
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # (3) launch
    launch_tiled(_int8_wo_kernel, m, n,
                 x2, w, s, bias if bias is not None else s, out,
                 m, n, k, k // s.shape[1],
                 x2.stride(0), w.stride(0), s.stride(0), out.stride(0),
                 HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_int8wo_plain", linear_int8wo_plain)
