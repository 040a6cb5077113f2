"""NF4 weight-only linear (NF4Layout bytes, with or without double quantization).

Byte j of row n holds code 2 j in its high nibble and 2 j + 1 in its low nibble (Note [NF4 bit layout]);
w = levels[code] * absmax[n, k // B]. With double quantization the absmax is decoded in the kernel:
absmax = scale_codes[n, b] * scale_block_scale[(n * K / B + b) // 256] + scale_offset
(Note [NF4 double quantization]). Serves ``torchqkit::linear_nf4wo``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import nf4_level
from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output


@triton.jit
def nf4_tile(args, DOUBLE_QUANT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) weights levels[code] * absmax[n, k // B] (Note [Tile loaders]); args = (q_ptr,
    absmax_ptr, dq_scale_ptr, dq_offset_ptr, BLOCK_SIZE_Q), see _nf4_kernel for what each points at."""
    q_ptr, absmax_ptr, dq_scale_ptr, dq_offset_ptr, BLOCK_SIZE_Q = args[0], args[1], args[2], args[3], args[4]
    wmask = (kk < K)[:, None] & (rn < N)[None, :]
    # ---- codes: high nibble for even k ----
    byte = tl.load(q_ptr + rn[None, :] * (K // 2) + (kk // 2)[:, None], mask=wmask, other=0).to(tl.int32)
    level = nf4_level(tl.where((kk % 2 == 0)[:, None], byte >> 4, byte & 0xF))
    # ---- absmax per (n, k // B) ----
    blk = rn[None, :] * (K // BLOCK_SIZE_Q) + (kk // BLOCK_SIZE_Q)[:, None]
    if DOUBLE_QUANT:
        c = tl.load(absmax_ptr + blk, mask=wmask, other=0).to(tl.float32)
        absmax = c * tl.load(dq_scale_ptr + blk // 256, mask=wmask, other=0.0) + tl.load(dq_offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + blk, mask=wmask, other=0.0)
    return tl.where(wmask, level * absmax, 0.0)


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K", "DOUBLE_QUANT"])
@triton.jit
def _nf4_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # (N, K / 2) uint8, two codes per byte, contiguous
    absmax_ptr,   # (N, K / B) float32 absmax, or (N, K / B) int8 codes when DOUBLE_QUANT
    dq_scale_ptr, # DOUBLE_QUANT: (ceil(N * K / B / 256)) float32 scales; else a dummy
    dq_offset_ptr,# DOUBLE_QUANT: (1) float32 offset; else a dummy
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K, BLOCK_SIZE_Q,   # BLOCK_SIZE_Q = B, the NF4 block along K
    # strides, in elements
    stride_xm, stride_om,
    # meta
    DOUBLE_QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0,
                                 nf4_tile, (q_ptr, absmax_ptr, dq_scale_ptr, dq_offset_ptr, BLOCK_SIZE_Q), DOUBLE_QUANT,
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def linear_nf4wo(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor | None, scale_codes: torch.Tensor | None,
                 scale_block_scale: torch.Tensor | None, scale_offset: torch.Tensor | None, block_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    n, k = qdata.shape[0], 2 * qdata.shape[1]
    double_quant = scale is None
    if qdata.dtype != torch.uint8 or x.shape[-1] != k or k % block_size:
        raise ValueError(f"linear_nf4wo (triton): need uint8 qdata (N, K/2), x (..., K), K % block_size == 0; got "
                         f"{qdata.dtype} {tuple(qdata.shape)}, x {tuple(x.shape)}, block_size {block_size}")
    if double_quant and (scale_codes is None or scale_block_scale is None or scale_offset is None):
        raise ValueError("linear_nf4wo (triton): pass scale, or all of scale_codes / scale_block_scale / scale_offset")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    absmax = (scale_codes if double_quant else scale.float()).contiguous()
    dq_scale = scale_block_scale.float().contiguous() if double_quant else absmax
    dq_offset = scale_offset.float().contiguous() if double_quant else absmax
    launch_tiled(_nf4_kernel, m, n,
                 x2, qdata.contiguous(), absmax, dq_scale, dq_offset, bias if bias is not None else absmax, out,
                 m, n, k, block_size, x2.stride(0), out.stride(0),
                 DOUBLE_QUANT=double_quant, HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_nf4wo", linear_nf4wo)
