"""float8 weight-only linear (Float8Layout bytes): w = float(q) * scale[n // bn, k // bk], the scale per
tensor (1, 1), per row (N, 1) or per block (N / bn, K / bk). The bytes are read as uint8 and decoded from
bits (decode.py), so sm80, which has no float8 hardware, runs it too. Serves ``torchqkit::linear_fp8wo``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .decode import e4m3fn_to_f32, e5m2_to_f32
from .registration import dot_precision, gpu_family, matmul_configs, register
from .tiles import load_x_tile, store_output, tile_offsets

_E5M2 = {torch.float8_e4m3fn: False, torch.float8_e5m2: True}


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K", "E5M2"])
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
    E5M2: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, rk = tile_offsets(BLOCK_M, BLOCK_N, BLOCK_K)
    scale_cols = K // SCALE_BK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = load_x_tile(x_ptr, rm, kk, stride_xm, M, K)
        wmask = (kk < K)[:, None] & (rn < N)[None, :]
        byte = tl.load(q_ptr + rn[None, :] * K + kk[:, None], mask=wmask, other=0).to(tl.int32)
        elem = e5m2_to_f32(byte) if E5M2 else e4m3fn_to_f32(byte)
        s = tl.load(scale_ptr + (rn // SCALE_BN)[None, :] * scale_cols + (kk // SCALE_BK)[:, None], mask=wmask, other=0.0)
        acc = tl.dot(x, (elem * s).to(x.dtype), acc, input_precision=DOT_PRECISION)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def linear_fp8wo(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if qdata.dtype not in _E5M2 or qdata.dim() != 2:
        raise ValueError(f"linear_fp8wo (triton): qdata must be (N, K) float8_e4m3fn / float8_e5m2, got "
                         f"{qdata.dtype} {tuple(qdata.shape)}")
    n, k = qdata.shape
    if x.shape[-1] != k or scale.dim() != 2 or n % scale.shape[0] or k % scale.shape[1]:
        raise ValueError(f"linear_fp8wo (triton): x (..., {x.shape[-1]}) and scale {tuple(scale.shape)} must fit "
                         f"a ({n}, {k}) weight with scale (N / bn, K / bk)")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s = scale.float().contiguous()
    if m and n:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
        wrap_triton(_fp8_wo_kernel)[grid](
            x2, qdata.contiguous().view(torch.uint8), s, bias if bias is not None else s, out,
            m, n, k, n // s.shape[0], k // s.shape[1], x2.stride(0), out.stride(0),
            E5M2=_E5M2[qdata.dtype], HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


OP = register("linear_fp8wo", linear_fp8wo)
