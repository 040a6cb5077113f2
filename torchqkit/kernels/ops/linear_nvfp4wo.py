"""torchqkit::linear_nvfp4wo(x, qdata, scale, global_scale, bias): weight-only NVFP4.

NVFP4Layout bytes: qdata (N, K/2) uint8, e2m1 codes, low nibble first; scale (N, K/16) float8_e4m3fn block scales;
global_scale (1,) float32, a divisor: w = e2m1 * (float(scale) / global_scale) (Note [NVFP4 bit layout] in
layouts/nvfp4.py). Backends: csrc/cpu/linear_lowbit_ops.cpp.
"""
from __future__ import annotations

import torch

from ..registry import define_weight_only_op
from .common import check_features, e2m1_values

__all__ = ["nvfp4_weight", "nvfp4_block_scales", "linear_nvfp4wo_ref"]

NVFP4_BLOCK = 16


def nvfp4_block_scales(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float8 block scales and the per-tensor divisor -> (N, K / 16) float32 block scales, E / G rounded once (the
    quotient compressed-tensors computes; exact for the oracle's power-of-two G)."""
    return scale.float() / global_scale.float()


def nvfp4_weight(qdata, scale, global_scale, k=None):
    """NVFP4Layout bytes -> (N, K) float32 weight."""
    return e2m1_values(qdata) * nvfp4_block_scales(scale, global_scale).repeat_interleave(NVFP4_BLOCK, 1)


OP = define_weight_only_op(
    "torchqkit::linear_nvfp4wo",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor global_scale, Tensor? bias=None) -> Tensor",
    weight=nvfp4_weight,
    out_features=lambda x, qdata, *_: qdata.shape[0],
    check=lambda x, qdata, scale, *_: check_features(x, NVFP4_BLOCK * scale.shape[1], "linear_nvfp4wo"))
linear_nvfp4wo_ref = OP.reference
