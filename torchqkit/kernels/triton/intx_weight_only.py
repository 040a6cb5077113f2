"""Packed integer weight-only linears (PackedIntxLayout bytes): 1..7-bit codes (``torchqkit::linear_intxwo``) and
ternary bit planes (``torchqkit::linear_ternarywo``), y = x @ W^T + bias.

- intx: code k of a row is the offset-binary field u = c - qmin at stream bits [k b, (k + 1) b) (Note [Packed intx
  bits]); w = c s, (c - z) s or (c - mid) s + z with the scale s and zero point z of (row // bn, k // group), as
  core/primitives.dequantize_affine computes it.
- ternary: per 8 codes a "nonzero" byte then a "negative" byte, bit j for code 8 m + j (Note [Ternary bit planes]);
  w = nonzero (1 - 2 negative) s.
Both decode in the shared K loop (tiles.dequant_matmul: a weight tile in registers, one ``tl.dot`` per step), as
the other weight-only formats do; the code width, signedness and zero-point domain are compile-time constants, so
each format compiles its own kernel where the field extraction unrolls.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import affine_value, packed_field
from .registration import dot_precision, gpu_family, launch_tiled, matmul_configs, register
from .tiles import activation_tile, dequant_matmul, store_output

_DOMAINS = {"none": 0, "int": 1, "float": 2}


@triton.jit
def _scale_index(rn, kk, G, GROUP, BN):
    """Where (row rn, column kk)'s scale and zero point sit in the (N / BN, G) tensors."""
    return (rn // BN)[None, :] * G + (kk // GROUP)[:, None]


@triton.jit
def intx_tile(args, FORMAT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) dequantized codes (Note [Tile loaders] in tiles.py); args = (q_ptr, scale_ptr, zero_ptr,
    ROW_BYTES, G, GROUP, BN); FORMAT = (bits, signed, zero-point domain)."""
    q_ptr, scale_ptr, zero_ptr, ROW_BYTES, G, GROUP, BN = args[0], args[1], args[2], args[3], args[4], args[5], args[6]
    BITS: tl.constexpr = FORMAT[0]
    SIGNED: tl.constexpr = FORMAT[1]
    DOMAIN: tl.constexpr = FORMAT[2]
    QMIN: tl.constexpr = -(1 << (BITS - 1)) if SIGNED else 0
    MID: tl.constexpr = 0 if SIGNED else 1 << (BITS - 1)
    mask = (kk < K)[:, None] & (rn < N)[None, :]
    code = (packed_field(q_ptr + rn[None, :] * ROW_BYTES, kk[:, None], BITS, ROW_BYTES, mask) + QMIN).to(tl.float32)
    q = _scale_index(rn, kk, G, GROUP, BN)
    s = tl.load(scale_ptr + q, mask=mask, other=0.0)
    if DOMAIN != 0:
        z = tl.load(zero_ptr + q, mask=mask, other=0.0)
    else:
        z = 0.0
    return tl.where(mask, affine_value(code, s, z, DOMAIN, MID), 0.0)


@triton.jit
def ternary_tile(args, FORMAT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) ternary weights (Note [Tile loaders]); args = (planes_ptr, scale_ptr, ROW_BYTES, G, GROUP,
    BN); FORMAT unused."""
    planes_ptr, scale_ptr, ROW_BYTES, G, GROUP, BN = args[0], args[1], args[2], args[3], args[4], args[5]
    mask = (kk < K)[:, None] & (rn < N)[None, :]
    row = planes_ptr + rn[None, :] * ROW_BYTES
    byte = (2 * (kk // 8))[:, None]
    bit = (kk % 8)[:, None]
    nonzero = (tl.load(row + byte, mask=mask, other=0).to(tl.int32) >> bit) & 1
    negative = (tl.load(row + byte + 1, mask=mask, other=0).to(tl.int32) >> bit) & 1
    s = tl.load(scale_ptr + _scale_index(rn, kk, G, GROUP, BN), mask=mask, other=0.0)
    return (nonzero * (1 - 2 * negative)).to(tl.float32) * s


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K", "BITS", "SIGNED", "DOMAIN"])
@triton.jit
def _intx_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    q_ptr,        # (N, ROW_BYTES = ceil(K * BITS / 8)) uint8, contiguous
    scale_ptr,    # (N / BN, G) float32, contiguous
    zero_ptr,     # (N / BN, G) float32 zero points (DOMAIN != 0), else a dummy
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K, ROW_BYTES, G, GROUP, BN,
    # strides, in elements
    stride_xm, stride_om,
    # meta
    BITS: tl.constexpr, SIGNED: tl.constexpr, DOMAIN: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0, intx_tile,
                                 (q_ptr, scale_ptr, zero_ptr, ROW_BYTES, G, GROUP, BN), (BITS, SIGNED, DOMAIN),
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K"])
@triton.jit
def _ternary_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm
    planes_ptr,   # (N, ROW_BYTES = 2 ceil(K / 8)) uint8, contiguous
    scale_ptr,    # (N / BN, G) float32, contiguous
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K, ROW_BYTES, G, GROUP, BN,
    # strides, in elements
    stride_xm, stride_om,
    # meta
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0, ternary_tile,
                                 (planes_ptr, scale_ptr, ROW_BYTES, G, GROUP, BN), 0,
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


def _check_scale(op: str, scale: torch.Tensor, n: int, k: int) -> None:
    if scale.dim() != 2 or n % max(scale.shape[0], 1) or k % max(scale.shape[1], 1) or not scale.numel():
        raise ValueError(f"{op} (triton): scale must be (N / bn, K / bk) dividing (N, K) = ({n}, {k}), got "
                         f"{tuple(scale.shape)}")


def linear_intxwo(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  bits: int, signed: bool, zero_point_domain: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    k, n = x.shape[-1], qdata.shape[0]
    if not 1 <= bits <= 7 or qdata.dtype != torch.uint8 or qdata.shape[1] != -(-k * bits // 8):
        raise ValueError(f"linear_intxwo (triton): bits must be 1..7 and qdata (N, ceil(K * bits / 8)) uint8 for "
                         f"K = {k}; got bits={bits}, qdata {qdata.dtype} {tuple(qdata.shape)}")
    if zero_point_domain not in _DOMAINS or (zero_point is None) != (zero_point_domain == "none"):
        raise ValueError(f"linear_intxwo (triton): zero_point_domain must be 'none' without a zero point, 'int' or "
                         f"'float' with one; got {zero_point_domain!r} and "
                         f"{'no zero point' if zero_point is None else 'a zero point'}")
    _check_scale("linear_intxwo", scale, n, k)
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s = scale.float().contiguous()  # the reference dequantizes in float32
    z = s if zero_point is None else zero_point.float().contiguous()
    launch_tiled(_intx_kernel, m, n,
                 x2, qdata.contiguous(), s, z, bias if bias is not None else s, out,
                 m, n, k, qdata.shape[1], s.shape[1], k // s.shape[1], n // s.shape[0], x2.stride(0), out.stride(0),
                 BITS=bits, SIGNED=signed, DOMAIN=_DOMAINS[zero_point_domain], HAS_BIAS=bias is not None,
                 DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


def linear_ternarywo(x: torch.Tensor, planes: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    k, n = x.shape[-1], planes.shape[0]
    if planes.dtype != torch.uint8 or planes.dim() != 2 or planes.shape[1] != 2 * -(-k // 8):
        raise ValueError(f"linear_ternarywo (triton): planes must be (N, 2 * ceil(K / 8)) uint8 for K = {k}; got "
                         f"{planes.dtype} {tuple(planes.shape)}")
    _check_scale("linear_ternarywo", scale, n, k)
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s = scale.float().contiguous()
    launch_tiled(_ternary_kernel, m, n,
                 x2, planes.contiguous(), s, bias if bias is not None else s, out,
                 m, n, k, planes.shape[1], s.shape[1], k // s.shape[1], n // s.shape[0], x2.stride(0), out.stride(0),
                 HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


INTX_OP = register("linear_intxwo", linear_intxwo)
TERNARY_OP = register("linear_ternarywo", linear_ternarywo)
