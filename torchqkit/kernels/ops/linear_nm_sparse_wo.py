"""torchqkit::linear_nm_sparse_wo(x, kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain, bias).

NMSparseLayout with integer codes (layouts/nm_sparse.py): of every block of ``m`` input features ``n`` codes are
kept. x (..., K) with K the stored (padded) in_features, a multiple of m. kept: bits < 8 packed offset-binary fields
(N, ceil(E * bits / 8)) uint8 (Note [Packed intx bits]), bits = 8 the codes themselves (N, E) int8 / uint8, E = K / m
* n; positions (N, ceil(E * b / 8)) uint8, b = position_bits(m) (Note [N:M sparse storage]); scale (N / bn, K / bk)
and zero_point (same shape, or None) as the oracle stores them; zero_point_domain "none" | "int" | "float".
w[r, c] = dequantize_affine(code, int<bits> / uint<bits>, (bn, bk), scale, zero_point) where (r, c) is kept, else
exactly 0 (Note [Pruned entries read as zero]). Returns (..., N).
Backends: csrc/cpu/linear_nm_sparse.cpp, kernels/triton.
"""
from __future__ import annotations

import torch

from ...core.primitives import dequantize_affine
from ...core.qdtype import INT, UINT
from ..registry import define_weight_only_op
from .linear_intxwo import intx_fields

__all__ = ["position_bits", "nm_sparse_weight", "linear_nm_sparse_wo_ref"]


def position_bits(m: int) -> int:
    """Bits of one stored position for blocks of ``m``: ceil(log2 m), at least 1 (2:4 -> 2, 4:8 -> 3)."""
    return max(1, (m - 1).bit_length())


def nm_sparse_weight(kept, positions, scale, zero_point, n, m, bits, signed, zero_point_domain, k):
    """The dense float32 (N, k) weight: kept codes dequantized at their columns, exact zeros elsewhere."""
    qdtype = (INT if signed else UINT)[bits]
    rows, e = kept.shape[0], k // m * n
    codes = kept.to(torch.int64) if bits == 8 else intx_fields(kept, bits, e) + int(qdtype.qmin)
    cols = (torch.arange(e, device=kept.device) // n * m + intx_fields(positions, position_bits(m), e))
    dense = torch.zeros(rows, k, dtype=torch.int64, device=kept.device).scatter_(1, cols, codes)
    mask = torch.zeros(rows, k, dtype=torch.bool, device=kept.device).scatter_(
        1, cols, torch.ones_like(cols, dtype=torch.bool))
    block = (rows // scale.shape[0], k // scale.shape[1])
    w = dequantize_affine(dense.clamp(int(qdtype.qmin), int(qdtype.qmax)), qdtype, block, scale, zero_point,
                          zero_point_domain=zero_point_domain, name="N:M sparse weight")
    return torch.where(mask, w, torch.zeros((), dtype=w.dtype, device=w.device))


def _check(x, kept, positions, scale, zero_point, n, m, bits, *_):
    k = x.shape[-1]
    e = k // m * n
    torch._check(k % m == 0, lambda: f"linear_nm_sparse_wo: K = {k} is not a multiple of m = {m} (pad x to the "
                                      f"stored in_features)")
    width = e if bits == 8 else -(-e * bits // 8)
    torch._check(kept.dim() == 2 and kept.shape[1] == width,
                 lambda: f"linear_nm_sparse_wo: kept must be (N, {width}) for K = {k}, {n}:{m}, bits = {bits}, "
                         f"got {tuple(kept.shape)}")
    torch._check(positions.dim() == 2 and positions.shape[1] == -(-e * position_bits(m) // 8),
                 lambda: f"linear_nm_sparse_wo: positions must be (N, {-(-e * position_bits(m) // 8)}) for K = {k}, "
                         f"{n}:{m}, got {tuple(positions.shape)}")


OP = define_weight_only_op(
    "torchqkit::linear_nm_sparse_wo",
    "(Tensor x, Tensor kept, Tensor positions, Tensor scale, Tensor? zero_point, int n, int m, int bits, bool signed, "
    "str zero_point_domain, Tensor? bias=None) -> Tensor",
    weight=nm_sparse_weight, out_features=lambda x, kept, *_: kept.shape[0], check=_check)
linear_nm_sparse_wo_ref = OP.reference
