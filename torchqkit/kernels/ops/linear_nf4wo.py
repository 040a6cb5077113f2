"""torchqkit::linear_nf4wo(x, qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size, bias).

NF4Layout bytes: qdata (N, K/2) uint8 (high nibble first); absmax either ``scale`` (N, K/B) or, with double
quantization, scale_codes (N, K/B) int8 * scale_block_scale[flat // 256] + scale_offset. Backends:
csrc/cpu/linear_lowbit.cpp, csrc/cuda/nf4_gemv.cu, kernels/triton.
"""
from __future__ import annotations

import torch

from ...core.qdtype import nf4
from ..registry import define_weight_only_op
from .common import check_features, split_nibbles

__all__ = ["nf4_absmax", "nf4_weight", "linear_nf4wo_ref"]


def nf4_absmax(scale, scale_codes, scale_block_scale, scale_offset):
    """The float32 absmax (N, K / B): stored, or decoded from double quantization (Note [NF4 double quantization])."""
    if scale is not None:
        return scale.float()
    flat = scale_codes.reshape(-1).float()
    blocks = torch.arange(flat.numel(), device=flat.device) // 256
    return (flat * scale_block_scale.float()[blocks] + scale_offset.float()).reshape(scale_codes.shape)


def nf4_weight(qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size, k=None):
    """NF4Layout bytes -> the float32 (N, K) weight (levels from core/qdtype)."""
    codes = split_nibbles(qdata, high_first=True).long()
    levels = torch.tensor(nf4.levels, dtype=torch.float32, device=qdata.device)
    absmax = nf4_absmax(scale, scale_codes, scale_block_scale, scale_offset)
    return levels[codes] * absmax.repeat_interleave(block_size, 1)


OP = define_weight_only_op(
    "torchqkit::linear_nf4wo",
    "(Tensor x, Tensor qdata, Tensor? scale, Tensor? scale_codes, Tensor? scale_block_scale, Tensor? scale_offset, "
    "int block_size, Tensor? bias=None) -> Tensor",
    weight=nf4_weight,
    out_features=lambda x, qdata, *_: qdata.shape[0],
    check=lambda x, qdata, *_: check_features(x, 2 * qdata.shape[1], "linear_nf4wo"))
linear_nf4wo_ref = OP.reference
