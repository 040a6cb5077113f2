"""Oracle: power-of-two (E8M0) scales, scale_rounding="power_of_two" (OCP Microscaling spec v1.0, 6.3)."""
from __future__ import annotations

import math

import pytest
import torch

from torchqkit.core import choose_qparams_affine, dequantize_affine, quantize_affine
from torchqkit.core import qdtypes as Q

POW2 = "power_of_two"


def _scale(x, qdtype, block=(1, 4), **kw):
    scale, zp = choose_qparams_affine(x, qdtype, block, scale_rounding=POW2, **kw)
    assert zp is None
    return scale


@pytest.mark.parametrize("qdtype,emax", [(Q.fp4_e2m1, 2), (Q.float8_e4m3fn, 8), (Q.float8_e5m2, 15)])
def test_shared_exponent_is_floor_log2_amax_minus_emax(qdtype, emax):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-20, 20, 64, base=2).unsqueeze(1)
    scale = _scale(x, qdtype, (1, 32))
    amax = x.abs().amax(dim=1).tolist()
    expected = torch.tensor([[2.0 ** (math.floor(math.log2(a)) - emax)] for a in amax])
    assert torch.equal(scale, expected)


def test_hand_values_fp4():
    x = torch.tensor([[6.0, 1, 1, 1], [7.9, 0, 0, 0], [8.0, 0, 0, 0], [-0.75, 0.1, 0, 0]])
    # 6 -> 2^(2-2); 7.9 -> 2^(2-2) (saturates); 8 -> 2^(3-2); 0.75 -> 2^(-1-2)
    assert _scale(x, Q.fp4_e2m1).flatten().tolist() == [1.0, 1.0, 2.0, 0.125]


def test_elements_saturate_at_the_format_max():
    x = torch.tensor([[7.9, -7.5, 0.5, 0.0]])  # amax/X = 7.9 > 6: the spec keeps X and saturates
    scale = _scale(x, Q.fp4_e2m1)
    codes = quantize_affine(x, Q.fp4_e2m1, (1, 4), scale)
    assert codes.tolist() == [[7, 15, 1, 0]]  # +6, -6, +0.5, +0
    assert dequantize_affine(codes, Q.fp4_e2m1, (1, 4), scale).tolist() == [[6.0, -6.0, 0.5, 0.0]]
    x8 = torch.tensor([[500.0, 1.0, 0, 0]])  # e4m3: X = 2^(8-8) = 1; 500 > 448 saturates
    q8 = quantize_affine(x8, Q.float8_e4m3fn, (1, 4), _scale(x8, Q.float8_e4m3fn))
    assert q8.float().tolist() == [[448.0, 1.0, 0.0, 0.0]]


def test_zero_block_gets_one_and_exponent_clamps_to_e8m0_range():
    x = torch.tensor([[0.0, 0, 0, 0], [1e-45, 0, 0, 0], [3e38, 0, 0, 0]])
    scale = _scale(x, Q.fp4_e2m1, check_finite=False)
    assert scale.flatten().tolist() == [1.0, 2.0 ** -127, 2.0 ** 125]
    big = _scale(torch.tensor([[3e38, 0, 0, 0]]), Q.nf4)  # nf4: emax 0 -> 2^127, the clamp
    assert big.item() == 2.0 ** 127


def test_scales_are_exact_powers_of_two_in_bf16_too():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    scale = _scale(x, Q.float8_e4m3fn, (1, 32))
    assert scale.dtype == torch.bfloat16
    mantissa, _ = torch.frexp(scale.float())
    assert torch.all(mantissa == 0.5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(qdtype=Q.int8), "float8 and codebook"),
    (dict(qdtype=Q.fp4_e2m1, eps=1e-6), "eps does not apply"),
    (dict(qdtype=Q.fp4_e2m1, scale_dtype=torch.float16), "use scale_dtype=torch.float32"),
    (dict(qdtype=Q.fp4_e2m1, scale_rounding="ceil"), "scale_rounding must be one of"),
])
def test_bad_requests_raise(kwargs, match):
    kwargs = {"scale_rounding": POW2, **kwargs}
    with pytest.raises(ValueError, match=match):
        choose_qparams_affine(torch.ones(2, 4), kwargs.pop("qdtype"), (1, 4), name="w", **kwargs)


def test_default_rounding_unchanged():
    x = torch.tensor([[3.0, 1, 0, 0]])
    scale, _ = choose_qparams_affine(x, Q.fp4_e2m1, (1, 4))
    assert scale.item() == 0.5  # amax / 6, not a power of two rounding
