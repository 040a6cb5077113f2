"""torchqkit::linear_fp6wo(x, qdata, scale, ebits, bias): weight-only FP6 (e3m2 when ebits = 3, e2m3 when 2).

FP6Layout bytes: qdata (N, ceil(K * 6 / 8)) uint8, each row a little-endian stream of 6-bit codes, four codes in
three bytes (Note [FP6 bit layout] in layouts/fp6.py); scale (N, G) float, one per row (G = 1) or per group of
K / G. w = fp6_value(code) * scale. Backends: csrc/cpu/linear_lowbit_ops.cpp.
"""
from __future__ import annotations

import torch

from ...core.qdtype import fp6_e2m3, fp6_e3m2
from ..registry import define_weight_only_op
from .common import expand_blocks
from .linear_intxwo import intx_fields

__all__ = ["fp6_qdtype", "fp6_weight", "linear_fp6wo_ref"]


def fp6_qdtype(ebits: int):
    """The FP6 qdtype with ``ebits`` exponent bits: 3 -> fp6_e3m2, 2 -> fp6_e2m3."""
    if ebits not in (2, 3):
        raise ValueError(f"FP6 has 3 (e3m2) or 2 (e2m3) exponent bits, got ebits={ebits}")
    return fp6_e3m2 if ebits == 3 else fp6_e2m3


def fp6_weight(qdata, scale, ebits, k):
    """FP6Layout bytes -> (N, K) float32 weight (values from core/qdtype's table)."""
    levels = torch.tensor(fp6_qdtype(ebits).levels, dtype=torch.float32, device=qdata.device)
    return levels[intx_fields(qdata, 6, k)] * expand_blocks(scale, (qdata.shape[0], k))


def _check(x, qdata, scale, ebits, *_):
    k = x.shape[-1]
    torch._check(qdata.dim() == 2 and qdata.shape[1] == -(-k * 6 // 8),
                 lambda: f"linear_fp6wo: qdata must be (N, ceil(K * 6 / 8)) for K = {k}, got {tuple(qdata.shape)}")
    torch._check(scale.dim() == 2 and scale.shape[0] == qdata.shape[0] and k % scale.shape[1] == 0,
                 lambda: f"linear_fp6wo: scale must be (N, G) with G dividing K = {k}, got {tuple(scale.shape)}")


OP = define_weight_only_op(
    "torchqkit::linear_fp6wo", "(Tensor x, Tensor qdata, Tensor scale, int ebits, Tensor? bias=None) -> Tensor",
    weight=fp6_weight, out_features=lambda x, qdata, *_: qdata.shape[0], check=_check)
linear_fp6wo_ref = OP.reference
