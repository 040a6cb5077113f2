"""Pieces several op modules share: per-token int8 activations (the oracle's numerics, as the C++ kernels
compute them), block-scale expansion, the fake impls' feature check, and the (x, qdata, scale, bias) op shape."""
from __future__ import annotations

import torch

from ...core.primitives import MappingType, ZeroPointDomain, choose_qparams_affine, quantize_affine
from ...core.qdtype import fp4_e2m1, int4, int8
from ..registry import OpDef, define_weight_only_op

__all__ = ["int8_activation_rows", "expand_blocks", "check_features", "split_nibbles", "pack_nibbles", "e2m1_values",
           "define_qdata_scale_op"]


def int8_activation_rows(x2: torch.Tensor, act_symmetric: bool, group_size: int = 0, bits: int = 8):
    """Per-token int8 (or, bits = 4, int4) quantization as the ops do it: (codes minus zero point, as float32; scale
    (M, 1)); with a group_size, one scale per token and group of group_size features: scale (M, K / group_size)."""
    k = x2.shape[1]
    block = (1, group_size or k)
    qdtype = {8: int8, 4: int4}[bits]
    mapping = MappingType.SYMMETRIC if act_symmetric else MappingType.ASYMMETRIC
    zpd = ZeroPointDomain.NONE if act_symmetric else ZeroPointDomain.INT
    a_scale, a_zp = choose_qparams_affine(x2, qdtype, block, mapping=mapping, zero_point_domain=zpd,
                                          scale_dtype=torch.float32, check_finite=False, name="activation")
    qa = quantize_affine(x2, qdtype, block, a_scale, a_zp, check_finite=False, name="activation").float()
    # A row holding NaN / Inf gives a NaN output row (as F.linear on the float row would), whatever its codes.
    a_scale = torch.where(torch.isfinite(x2).all(1, keepdim=True), a_scale, float("nan"))
    return (qa if a_zp is None else qa - a_zp.float()), a_scale


def expand_blocks(scale: torch.Tensor, shape) -> torch.Tensor:
    """(N / bn, K / bk) -> (N, K) float32, repeating each block's scale."""
    return scale.float().repeat_interleave(shape[0] // scale.shape[0], 0).repeat_interleave(shape[1] // scale.shape[1], 1)


def check_features(x, k: int, name: str) -> None:
    torch._check(x.shape[-1] == k, lambda: f"{name}: x has {x.shape[-1]} features but the weight has K = {k}")


def define_qdata_scale_op(name: str, weight, in_features=lambda qdata, scale: qdata.shape[1]) -> OpDef:
    """A weight-only op whose weight is one (qdata, scale) pair, N = qdata rows:
    ``torchqkit::<op>(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None) -> Tensor``.
    ``weight(qdata, scale, k)`` is the format's decoder; ``in_features(qdata, scale)`` is K (the fake checks x)."""
    short = name.split("::")[1]
    return define_weight_only_op(
        name, "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None) -> Tensor", weight=weight,
        out_features=lambda x, qdata, *_: qdata.shape[0],
        check=lambda x, qdata, scale, *_: check_features(x, in_features(qdata, scale), short))


def split_nibbles(packed: torch.Tensor, high_first: bool) -> torch.Tensor:
    """(N, B) uint8, two 4-bit codes per byte -> (N, 2 B) uint8 codes: byte j holds codes 2j and 2j + 1, code 2j in
    the high nibble when ``high_first`` (NF4, bitsandbytes' order) else in the low one (MXFP4, packed int4).

    A broadcast shift, not torch.stack of the two halves: inductor lowers such a stack to a separate cat that
    unpacks the whole tensor, where the shift fuses into the consumer (a gather then decodes only its rows)."""
    shifts = torch.tensor([4, 0] if high_first else [0, 4], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, 2 B) 4-bit codes -> (N, B) uint8, code 2j in the low nibble of byte j (MXFP4 / NVFP4, e2m1's packing in
    torch.float4_e2m1fn_x2): the inverse of ``split_nibbles(packed, high_first=False)``."""
    return ((codes[:, 1::2] << 4) | codes[:, 0::2]).contiguous()


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """(N, B) uint8, two e2m1 codes per byte (low nibble first) -> (N, 2 B) float32 e2m1 values (core/qdtype's
    table): the element decoder MXFP4 and NVFP4 share."""
    table = torch.tensor(fp4_e2m1.levels, dtype=torch.float32, device=packed.device)
    return table[split_nibbles(packed, high_first=False).long()]
