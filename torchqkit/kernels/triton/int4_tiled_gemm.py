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
from torch.library import wrap_triton

from . import int4_tiled_gemv
from .decode import int4_tiled_tile
from .registration import dot_precision, gpu_family, matmul_configs, register
from .tiles import load_x_tile, store_output, tile_offsets

GEMV_MAX_M = 4  # decode: a few tokens; above this the weight tile is reused across M in the GEMM


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
    rm, rn, rk = tile_offsets(BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- K loop: unpack the tile's nibbles, dequantize, one tl.dot ----
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = load_x_tile(x_ptr, rm, kk, stride_xm, M, K)
        w = int4_tiled_tile(q_ptr, sz_ptr, rn, kk, N, K, GROUP, NUM_CHUNKS, WORDS, N8)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
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
    if m and out_features:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(out_features, meta["BLOCK_N"]))  # noqa: E731
        wrap_triton(_int4_tiled_gemm_kernel)[grid](
            x2, qdata.contiguous(), scale_and_zero.contiguous(), bias if bias is not None else scale_and_zero, out,
            m, out_features, k, group_size, qdata.shape[1], qdata.shape[3], n8, x2.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x2.dtype))
    return out


OP = register("linear_int4wo_tiled", linear_int4wo_tiled)
