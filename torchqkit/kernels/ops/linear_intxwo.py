"""torchqkit::linear_intxwo(x, qdata, scale, zero_point, bits, signed, zero_point_domain, bias).

PackedIntxLayout bytes (not ternary): qdata (N, ceil(K * bits / 8)) uint8, bits 1..7, each row a little-endian
stream of offset-binary fields u = q - qmin (Note [Packed intx bits]); scale (N / bn, K / bk) and zero_point
(same shape, or None) as the oracle stores them; zero_point_domain "none" | "int" | "float".
w = dequantize_affine(u + qmin, int<bits> / uint<bits>, (bn, bk), scale, zero_point). Returns (..., N).
Backends: csrc/cpu/linear_lowbit.cpp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.primitives import dequantize_affine
from ...core.qdtype import INT, UINT
from ..registry import define_weight_only_op

__all__ = ["intx_fields", "pack_intx_fields", "intx_weight", "linear_intxwo_ref"]


def intx_fields(qdata, bits, k):
    """(N, ceil(K * bits / 8)) uint8 -> (N, K) int64 offset-binary fields (Note [Packed intx bits], layouts)."""
    bit = torch.arange(k, device=qdata.device) * bits
    byte = bit // 8
    word = qdata[:, byte].long() | (qdata[:, (byte + 1).clamp(max=qdata.shape[1] - 1)].long() << 8)
    return (word >> (bit % 8)) & ((1 << bits) - 1)


def pack_intx_fields(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) uint8 fields < 2**bits -> (N, ceil(K * bits / 8)) uint8: the inverse of ``intx_fields``."""
    n, k = fields.shape
    k8 = -(-k // 8) * 8
    x = F.pad(fields.to(torch.int64), (0, k8 - k)).reshape(n, k8 // 8, 8)
    dev = fields.device
    words = (x << torch.arange(0, 8 * bits, bits, device=dev)).sum(-1)  # 8 fields = 8 * bits <= 56 bits
    out = (words.unsqueeze(-1) >> torch.arange(0, 8 * bits, 8, device=dev)) & 0xFF
    return out.reshape(n, k8 // 8 * bits)[:, : -(-k * bits // 8)].to(torch.uint8)


def intx_weight(qdata, scale, zero_point, bits, signed, zero_point_domain, k):
    qdtype = (INT if signed else UINT)[bits]
    codes = intx_fields(qdata, bits, k) + int(qdtype.qmin)
    block = (qdata.shape[0] // scale.shape[0], k // scale.shape[1])
    return dequantize_affine(codes, qdtype, block, scale, zero_point, zero_point_domain=zero_point_domain,
                             name="packed intx weight")


def _check(x, qdata, scale, zero_point, bits, *_):
    torch._check(qdata.dim() == 2 and qdata.shape[1] == -(-x.shape[-1] * bits // 8),
                 lambda: f"linear_intxwo: qdata must be (N, ceil(K * bits / 8)) for K = {x.shape[-1]}, bits = {bits}, "
                         f"got {tuple(qdata.shape)}")


OP = define_weight_only_op(
    "torchqkit::linear_intxwo",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? zero_point, int bits, bool signed, str zero_point_domain, "
    "Tensor? bias=None) -> Tensor",
    weight=intx_weight, out_features=lambda x, qdata, *_: qdata.shape[0], check=_check)
linear_intxwo_ref = OP.reference
