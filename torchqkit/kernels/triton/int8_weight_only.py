"""int8 weight-only linear (PlainLayout bytes): y = x @ (qdata * scale[n, k // g]).T + bias.

The weight tile is dequantized in registers inside the K loop (fp32, then the activation dtype for
``tl.dot``), so the int8 bytes are the only weight traffic. Serves ``torchqkit::linear_int8wo_plain``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .registration import dot_precision, gpu_family, matmul_configs, register
from .tiles import load_x_tile, store_output, tile_offsets


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
    # ---- tile coordinates ----
    rm, rn, rk = tile_offsets(BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- K loop: load codes + scales, dequantize (BLOCK_K, BLOCK_N), one tl.dot ----
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = load_x_tile(x_ptr, rm, kk, stride_xm, M, K)
        wmask = (kk < K)[:, None] & (rn < N)[None, :]
        q = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=wmask, other=0)
        s = tl.load(scale_ptr + rn[None, :] * stride_sn + (kk // GROUP)[:, None], mask=wmask, other=0.0)
        w = (q.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
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
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    # (3) launch
    m = x2.shape[0]
    if m and n:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
        wrap_triton(_int8_wo_kernel)[grid](
            x2, w, s, bias if bias is not None else s, out,
            m, n, k, k // s.shape[1],
            x2.stride(0), w.stride(0), s.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_int8wo_plain", linear_int8wo_plain)
