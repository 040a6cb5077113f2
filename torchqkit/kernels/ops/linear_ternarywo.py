"""torchqkit::linear_ternarywo(x, planes, scale, bias): ternary weights in bit planes (Note [Ternary bit planes],
layouts/packed_intx.py) times float activations. The C++ CPU kernel adds table entries instead of multiplying
(Note [Ternary lookup tables], csrc/cpu/linear_ternary.cpp); the reference decodes the planes and runs F.linear."""
from __future__ import annotations

import torch

from ...core.primitives import ZeroPointDomain, dequantize_affine
from ...core.qdtype import int2
from ..registry import define_weight_only_op


def ternary_codes(planes: torch.Tensor, k: int) -> torch.Tensor:
    """(N, 2 ceil(K / 8)) uint8 planes -> (N, K) int8 codes in {-1, 0, 1}: per 8 codes a nonzero byte, then a
    negative byte, bit j for code 8 m + j."""
    n = planes.shape[0]
    bits = (planes.to(torch.int32).reshape(n, -1, 2, 1) >> torch.arange(8, device=planes.device)) & 1
    codes = bits[:, :, 0] * (1 - 2 * bits[:, :, 1])  # (N, K8 / 8, 8)
    return codes.reshape(n, -1)[:, :k].to(torch.int8)


def ternary_weight(planes, scale, k):
    block = (planes.shape[0] // scale.shape[0], k // scale.shape[1])
    return dequantize_affine(ternary_codes(planes, k), int2, block, scale, None,
                             zero_point_domain=ZeroPointDomain.NONE, name="ternary weight")


def _check(x, planes, scale, *_):
    k = x.shape[-1]
    torch._check(planes.dim() == 2 and planes.shape[1] == 2 * -(-k // 8),
                 lambda: f"linear_ternarywo: planes must be (N, 2 * ceil(K / 8)) for K = {k}, "
                         f"got {tuple(planes.shape)}")


OP = define_weight_only_op(
    "torchqkit::linear_ternarywo", "(Tensor x, Tensor planes, Tensor scale, Tensor? bias=None) -> Tensor",
    weight=ternary_weight, out_features=lambda x, planes, *_: planes.shape[0], check=_check)
linear_ternarywo_ref = OP.reference
