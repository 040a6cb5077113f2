"""int4 tensor-core-tiled weight x fp16 / bf16 / fp32 activations: the prefill GEMM.

Reads TensorCoreTiledLayout's words as stored (see Note [Tensor-core tiled int4] in
layouts/tensor_core_tiled.py): for element (n, k) with n = 8 i + r and k = 16 T j + 16 t + 8 h + 2 c + e,
the code is nibble p = 4 e + 2 (t % 2) + h of word t // 2 of lane 4 r + c in tile (i, j).
w = (q - 8) * scale + zero with (scale, zero) = scale_and_zero[k // g, n]. Serves
``torchqkit::linear_int4wo_tiled``: M <= GEMV_MAX_M goes to the split-K kernel (int4_tiled_gemv.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import int4_tiled_gemv
from .decode import int4_tiled_tile
from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output

GEMV_MAX_M = 4  # decode: a few tokens; above this the weight tile is reused across M in the GEMM


@triton.jit
def int4_tiled_loader(args, FORMAT: tl.constexpr, rn, kk, N, K):
    """decode.int4_tiled_tile as a tile loader (Note [Tile loaders]); args = (q_ptr, sz_ptr, GROUP, NUM_CHUNKS,
    WORDS, N8)."""
    return int4_tiled_tile(args[0], args[1], rn, kk, N, K, args[2], args[3], args[4], args[5])


@triton.autotune(configs=matmul_configs(gpu_family(), k_multiple=32), key=["M", "N", "K"])
@triton.jit
def _int4_tiled_gemm_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # int32 tiles [N8 / 8][NUM_CHUNKS][32][WORDS], contiguous
    sz_ptr,       # [Kt / GROUP][N8][2] scale and zero point, contiguous
    bias_ptr,     # (N) or a dummy pointer when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K, GROUP, NUM_CHUNKS, WORDS, N8,
    # strides, in elements
    stride_xm, stride_om,
    # meta
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0,
                                 int4_tiled_loader, (q_ptr, sz_ptr, GROUP, NUM_CHUNKS, WORDS, N8), 0,
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def check_int4_tiled(x, qdata, scale_and_zero, group_size, out_features):
    """Real errors for what the kernels assume; returns (K, N8)."""
    k = x.shape[-1]
    if qdata.dtype != torch.int32 or qdata.dim() != 4 or qdata.shape[2] != 32:
        raise ValueError(f"linear_int4wo_tiled (triton): qdata must be int32 [N8/8][chunks][32][T/2] tiles, "
                         f"got {qdata.dtype} {tuple(qdata.shape)}")
    n8, kt = qdata.shape[0] * 8, qdata.shape[1] * 32 * qdata.shape[3]
    if not (out_features <= n8 and k <= kt and k % group_size == 0 and scale_and_zero.shape[1:] == (n8, 2)):
        raise ValueError(f"linear_int4wo_tiled (triton): x (..., {k}) / out_features {out_features} / group "
                         f"{group_size} don't fit tiles for ({n8}, {kt}) and scale_and_zero {tuple(scale_and_zero.shape)}")
    return k, n8


def linear_int4wo_tiled(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int,
                        out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    k, _ = check_int4_tiled(x, qdata, scale_and_zero, group_size, out_features)
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], out_features
    launch = int4_tiled_gemv.launch if m <= GEMV_MAX_M else launch_gemm
    return launch(x2, qdata, scale_and_zero, group_size, n, bias).reshape(*x.shape[:-1], n)


def launch_gemm(x2, qdata, scale_and_zero, group_size, out_features, bias=None):
    """The GEMM kernel on a contiguous (M, K) x2, any M (tests run it on M = 1 too)."""
    k, n8 = check_int4_tiled(x2, qdata, scale_and_zero, group_size, out_features)
    m = x2.shape[0]
    out = torch.empty(m, out_features, dtype=x2.dtype, device=x2.device)
    launch_tiled(_int4_tiled_gemm_kernel, m, out_features,
                 x2, qdata.contiguous(), scale_and_zero.contiguous(), bias if bias is not None else scale_and_zero, out,
                 m, out_features, k, group_size, qdata.shape[1], qdata.shape[3], n8, x2.stride(0), out.stride(0),
                 HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x2.dtype))
    return out


OP = register("linear_int4wo_tiled", linear_int4wo_tiled)
