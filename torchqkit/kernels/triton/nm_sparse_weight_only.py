"""N:M sparse integer weight-only linear (NMSparseLayout's kept codes and positions): y = x @ W^T + bias.

Kept entry j of row r is the code c of a 1..8-bit integer qdtype (below 8 bits the offset-binary field u = c - qmin,
Note [Packed intx bits]; at 8 bits the int8 / uint8 byte itself) at column (j // n) m + position[r, j] (Note [N:M
sparse storage], layouts/nm_format.py). w = c s, (c - z) s or (c - mid) s + z with the scale s and zero point z of
(r // bn, column // group); every column no entry names is exactly 0. Serves ``torchqkit::linear_nm_sparse_wo``.

Note [N:M sparse Triton kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two kernels read the stored bytes only, picked by the number of tokens M (as csrc/cpu/linear_nm_sparse.cpp does):
- M <= GEMV_MAX_M, a split-K GEMV over kept entries that gathers activations by position: a program decodes a
  (BLOCK_K entries, BLOCK_N rows) tile of kept weights and their columns, loads x[t, column] for each and reduces
  with a multiply + sum per token. It touches E = K n / m entries per row, never a dense weight. No ``tl.dot``, so
  bfloat16 activations also run right under the interpreter.
- Larger M, the shared GEMM (tiles.dequant_matmul) with a dense tile loader: for dense column k of row r (block
  b = k // m, position p = k % m) it compares the n position fields of block b with p and dequantizes the entry that
  matches; no match is an exact 0. That is n position reads per dense weight, from bytes the tile already brought in
  (n / m of them per weight), then ``tl.dot`` as in every GEMM here.
Both take any n:m (m <= 128, positions in ceil(log2 m) bits), 1..8-bit codes of either sign, every zero-point
domain, any group size (a group need not hold whole blocks) and row blocks of the scale (bn > 1), entries stored
in any order inside their block. The format is a tuple of compile-time constants, FORMAT = (n, m, bits,
position bits, signed, domain): each pattern and code width compiles its own kernel, where divisions by m and the
position search over n unroll.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import affine_value, packed_field
from .registration import (dot_precision, gemv_configs, gpu_family, launch_tiled, matmul_configs, register,
                           traceable)
from .tiles import activation_tile, dequant_matmul, store_output

GEMV_MAX_M = 4  # decode: a few tokens, gathered by position; above this the GEMM reuses each dense tile across M
_DOMAINS = {"none": 0, "int": 1, "float": 2}
_FORMAT_KEY = ["N_KEEP", "M_BLOCK", "BITS", "SIGNED", "DOMAIN"]


@triton.jit
def kept_weight(args, FORMAT: tl.constexpr, rn, j, col, mask):
    """Dequantized kept entries j (broadcast against rows rn) that sit at columns col, float32, 0 where not mask.
    args = (kept_ptr, pos_ptr, scale_ptr, zero_ptr, KEPT_BYTES, POS_BYTES, G, GROUP, BN): see _nm_gemm_kernel."""
    kept_ptr, scale_ptr, zero_ptr = args[0], args[2], args[3]
    KEPT_BYTES, G, GROUP, BN = args[4], args[6], args[7], args[8]
    BITS: tl.constexpr = FORMAT[2]
    SIGNED: tl.constexpr = FORMAT[4]
    DOMAIN: tl.constexpr = FORMAT[5]
    row = kept_ptr + rn[None, :] * KEPT_BYTES
    if BITS == 8:
        code = tl.load(row + j, mask=mask, other=0).to(tl.float32)  # int8 / uint8 bytes: the load keeps the sign
    else:
        QMIN: tl.constexpr = -(1 << (BITS - 1)) if SIGNED else 0
        code = (packed_field(row, j, BITS, KEPT_BYTES, mask) + QMIN).to(tl.float32)
    q = (rn // BN)[None, :] * G + col // GROUP
    s = tl.load(scale_ptr + q, mask=mask, other=0.0)
    if DOMAIN != 0:
        z = tl.load(zero_ptr + q, mask=mask, other=0.0)
    else:
        z = 0.0
    MID: tl.constexpr = 0 if SIGNED else 1 << (BITS - 1)
    return tl.where(mask, affine_value(code, s, z, DOMAIN, MID), 0.0)


@triton.jit
def nm_dense_tile(args, FORMAT: tl.constexpr, rn, kk, N, K):
    """(BLOCK_K, BLOCK_N) dense weights (Note [Tile loaders]): per column, the entry of its block whose position
    matches, dequantized, else 0 (Note [N:M sparse Triton kernels])."""
    pos_ptr, POS_BYTES = args[1], args[5]
    N_KEEP: tl.constexpr = FORMAT[0]
    M_BLOCK: tl.constexpr = FORMAT[1]
    PBITS: tl.constexpr = FORMAT[3]
    valid = (kk < K)[:, None] & (rn < N)[None, :]
    first = (kk // M_BLOCK * N_KEEP)[:, None]     # entry 0 of each column's block
    p = (kk % M_BLOCK)[:, None]
    pos_row = pos_ptr + rn[None, :] * POS_BYTES
    hit = tl.full(valid.shape, -1, tl.int32)      # the entry at this column, -1: none (a pruned weight)
    for i in range(N_KEEP):
        at = packed_field(pos_row, first + i, PBITS, POS_BYTES, valid) == p
        hit = tl.where(at, first + i, hit)
    return kept_weight(args, FORMAT, rn, tl.maximum(hit, 0), kk[:, None], valid & (hit >= 0))


@triton.autotune(configs=matmul_configs(gpu_family()), key=["M", "N", "K", *_FORMAT_KEY])
@triton.jit
def _nm_gemm_kernel(
    # pointers
    x_ptr,        # (M, K) activations, row stride stride_xm; K the stored (padded) in_features
    kept_ptr,     # (N, KEPT_BYTES): int8 / uint8 codes (BITS = 8) or packed offset-binary fields, contiguous
    pos_ptr,      # (N, POS_BYTES) uint8 position fields, contiguous
    scale_ptr,    # (N / BN, G) float32, contiguous
    zero_ptr,     # (N / BN, G) float32 zero points (DOMAIN != 0), else a dummy
    bias_ptr,     # (N) or a dummy when HAS_BIAS is False
    out_ptr,      # (M, N), row stride stride_om
    # sizes
    M, N, K, KEPT_BYTES, POS_BYTES, G, GROUP, BN,
    # strides, in elements
    stride_xm, stride_om,
    # meta: the format (Note [N:M sparse Triton kernels]), then the launch's
    N_KEEP: tl.constexpr, M_BLOCK: tl.constexpr, BITS: tl.constexpr, PBITS: tl.constexpr, SIGNED: tl.constexpr,
    DOMAIN: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm, rn, acc = dequant_matmul(activation_tile, (x_ptr, stride_xm), 0,
                                 nm_dense_tile, (kept_ptr, pos_ptr, scale_ptr, zero_ptr, KEPT_BYTES, POS_BYTES, G,
                                                 GROUP, BN), (N_KEEP, M_BLOCK, BITS, PBITS, SIGNED, DOMAIN),
                                 M, N, K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(out_ptr, acc, rm, rn, stride_om, M, N, bias_ptr, HAS_BIAS)


_GEMV_CONFIGS = gemv_configs(gpu_family())
MAX_SPLIT = max(c.kwargs["SPLIT_K"] for c in _GEMV_CONFIGS)  # the partial buffer fits whichever config is picked


@triton.autotune(configs=_GEMV_CONFIGS, key=["M", "N", "K", *_FORMAT_KEY])
@triton.jit
def _nm_gemv_kernel(
    # pointers (as _nm_gemm_kernel's)
    x_ptr, kept_ptr, pos_ptr, scale_ptr, zero_ptr,
    part_ptr,     # (MAX_SPLIT, M, N) float32 partial sums, zero-filled; slice s written by entry slice s
    # sizes: E = K / M_BLOCK * N_KEEP kept entries per row
    M, N, K, E, KEPT_BYTES, POS_BYTES, G, GROUP, BN,
    stride_xm,
    # meta: BLOCK_K counts kept entries per step (gemv_configs' K tile)
    N_KEEP: tl.constexpr, M_BLOCK: tl.constexpr, BITS: tl.constexpr, PBITS: tl.constexpr, SIGNED: tl.constexpr,
    DOMAIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    FORMAT: tl.constexpr = (N_KEEP, M_BLOCK, BITS, PBITS, SIGNED, DOMAIN)
    args = (kept_ptr, pos_ptr, scale_ptr, zero_ptr, KEPT_BYTES, POS_BYTES, G, GROUP, BN)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(1)
    re = tl.arange(0, BLOCK_K)
    per_split = tl.cdiv(tl.cdiv(E, SPLIT_K), BLOCK_K) * BLOCK_K
    e_begin = pid_k * per_split
    e_end = tl.minimum(e_begin + per_split, E)
    pos_row = pos_ptr + rn[None, :] * POS_BYTES
    # ---- one token at a time: decoding is cheap next to the stored bytes, which stay in cache across tokens ----
    for t in range(0, M):
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for e0 in range(e_begin, e_end, BLOCK_K):
            j = (e0 + re)[:, None]
            mask = (j < e_end) & (rn < N)[None, :]
            col = j // N_KEEP * M_BLOCK + packed_field(pos_row, j, PBITS, POS_BYTES, mask)
            w = kept_weight(args, FORMAT, rn, j, col, mask)
            # col < K holds for every stored position (< m); the mask only keeps a corrupt one inside the row
            x = tl.load(x_ptr + t * stride_xm + col, mask=mask & (col < K), other=0.0).to(tl.float32)
            acc += tl.sum(x * w, axis=0)
        tl.store(part_ptr + (pid_k * M + t) * N + rn, acc, mask=rn < N)


def _check(x, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain):
    """Real errors for what the kernels assume (the op's fake checks the shapes too); returns (K, E, pbits)."""
    where = "linear_nm_sparse_wo (triton)"
    k = x.shape[-1]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: activations must be float32, bfloat16 or float16, got {x.dtype}")
    if not (1 <= n < m <= 128 and 1 <= bits <= 8) or k % m:
        raise ValueError(f"{where}: need 1 <= n < m <= 128, bits 1..8 and K a multiple of m (pad x to the stored "
                         f"in_features); got {n}:{m}, bits = {bits}, K = {k}")
    e, pbits = k // m * n, max(1, (m - 1).bit_length())
    width = e if bits == 8 else -(-e * bits // 8)
    want = (torch.int8 if signed else torch.uint8) if bits == 8 else torch.uint8
    if kept.dim() != 2 or kept.dtype != want or kept.shape[1] != width:
        raise ValueError(f"{where}: kept must be {want} (N, {width}) for K = {k}, {n}:{m}, bits = {bits}, signed = "
                         f"{signed}; got {kept.dtype} {tuple(kept.shape)}")
    rows = kept.shape[0]
    if positions.dtype != torch.uint8 or tuple(positions.shape) != (rows, -(-e * pbits // 8)):
        raise ValueError(f"{where}: positions must be uint8 ({rows}, {-(-e * pbits // 8)}) for K = {k}, {n}:{m}; got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if scale.dim() != 2 or not scale.shape[0] or not scale.shape[1] or rows % scale.shape[0] or k % scale.shape[1]:
        raise ValueError(f"{where}: scale must be 2-d (N / bn, K / bk) dividing (N, K) = ({rows}, {k}); got "
                         f"{tuple(scale.shape)}")
    if zero_point_domain not in _DOMAINS or (zero_point_domain == "none") != (zero_point is None):
        raise ValueError(f"{where}: zero_point_domain must be 'none' without a zero_point, 'int' or 'float' with one; "
                         f"got {zero_point_domain!r} and zero_point {'None' if zero_point is None else 'given'}")
    if zero_point is not None and zero_point.shape != scale.shape:
        raise ValueError(f"{where}: zero_point must have the scale's shape {tuple(scale.shape)}, got "
                         f"{tuple(zero_point.shape)}")
    return k, e, pbits


def _operands(x2, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain):
    """The kernels' tensor and size arguments and their format constants, after the checks."""
    k, e, pbits = _check(x2, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain)
    kept, positions = kept.contiguous(), positions.contiguous()
    s = scale.float().contiguous()
    z = s if zero_point is None else zero_point.float().contiguous()
    sizes = (kept.shape[1], positions.shape[1], s.shape[1], k // s.shape[1], kept.shape[0] // s.shape[0])
    fmt = dict(N_KEEP=n, M_BLOCK=m, BITS=bits, PBITS=pbits, SIGNED=signed, DOMAIN=_DOMAINS[zero_point_domain])
    return (kept, positions, s, z), e, sizes, fmt


def launch_gemv(x2, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain, bias=None):
    """The gather-by-position GEMV on a contiguous (M, K) x2, any M (tests run it past GEMV_MAX_M too)."""
    tensors, e, sizes, fmt = _operands(x2, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain)
    tokens, k = x2.shape
    rows = kept.shape[0]
    parts = torch.zeros(MAX_SPLIT, tokens, rows, dtype=torch.float32, device=x2.device)
    if tokens and rows:
        grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
        traceable(_nm_gemv_kernel)[grid](x2, *tensors, parts, tokens, rows, k, e, *sizes, x2.stride(0), **fmt)
    out = parts.sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(x2.dtype)


def launch_gemm(x2, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain, bias=None):
    """The dense-tile GEMM on a contiguous (M, K) x2, any M (tests run it on M = 1 too)."""
    tensors, _, sizes, fmt = _operands(x2, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain)
    tokens, k = x2.shape
    rows = kept.shape[0]
    out = torch.empty(tokens, rows, dtype=x2.dtype, device=x2.device)
    launch_tiled(_nm_gemm_kernel, tokens, rows, x2, *tensors, bias if bias is not None else tensors[2], out,
                 tokens, rows, k, *sizes, x2.stride(0), out.stride(0),
                 HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x2.dtype), **fmt)
    return out


def linear_nm_sparse_wo(x: torch.Tensor, kept: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor,
                        zero_point: torch.Tensor | None, n: int, m: int, bits: int, signed: bool,
                        zero_point_domain: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    launch = launch_gemv if x2.shape[0] <= GEMV_MAX_M else launch_gemm
    out = launch(x2, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain, bias)
    return out.reshape(*x.shape[:-1], kept.shape[0])


OP = register("linear_nm_sparse_wo", linear_nm_sparse_wo)
