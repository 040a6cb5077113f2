"""Oracle properties over random shapes, block sizes and qdtypes (seeded, so failures reproduce)."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.core import (MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine,
                            parse_calibration, qdtypes as Q, quantize_affine)
from torchqkit.core.qdtype import QKind, all_qdtypes

INT_QDTYPES = [q for q in all_qdtypes() if q.kind is QKind.INT]
# (mapping, zero point domain) pairs the oracle accepts for integer codes.
INT_SCHEMES = [
    (MappingType.SYMMETRIC, None), (MappingType.SYMMETRIC_NO_CLIPPING_ERR, None),
    (MappingType.ASYMMETRIC, ZeroPointDomain.INT), (MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT),
]


def _random_case(seed: int):
    """A random 2-d or 3-d shape and a block_size whose entries divide it (any axes: subchannel blocks)."""
    g = torch.Generator().manual_seed(seed)
    ndim = 2 + seed % 2
    blocks = [int(b) for b in torch.tensor([1, 2, 4, 8, 16, 32])[torch.randint(0, 6, (ndim,), generator=g)]]
    shape = [b * int(torch.randint(1, 4, (1,), generator=g)) for b in blocks]
    x = torch.randn(shape, generator=g) * float(torch.rand(1, generator=g) * 10 + 0.01)
    return x, tuple(blocks), g


def _is_signed_sym(q, mapping):
    return q.signed or mapping is MappingType.ASYMMETRIC


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("qdtype", INT_QDTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("mapping,zpd", INT_SCHEMES, ids=lambda v: getattr(v, "value", str(v)))
def test_int_codes_in_range_and_error_within_half_step(seed, qdtype, mapping, zpd):
    x, block, _ = _random_case(seed)
    if zpd is None and not qdtype.signed:
        zpd = ZeroPointDomain.INT  # unsigned symmetric codes are centred on the midpoint code
    scale, zp = choose_qparams_affine(x, qdtype, block, mapping=mapping, zero_point_domain=zpd)
    codes = quantize_affine(x, qdtype, block, scale, zp, zero_point_domain=zpd)
    assert codes.dtype == qdtype.storage_dtype and codes.shape == x.shape
    assert int(codes.min()) >= qdtype.qmin and int(codes.max()) <= qdtype.qmax
    deq = dequantize_affine(codes, qdtype, block, scale, zp, zero_point_domain=zpd)
    # In-range values (those that map inside [qmin, qmax] before rounding) are within half a step.
    s = scale.repeat_interleave(block[0], 0)
    for d in range(1, x.ndim):
        s = s.repeat_interleave(block[d], d)
    lo, hi = _representable_range(qdtype, scale, zp, zpd, block, x.shape)
    inside = (x >= lo) & (x <= hi)
    err = (x - deq).abs()
    assert bool((err[inside] <= s[inside] * 0.5 * (1 + 1e-5) + 1e-6).all())


def _representable_range(qdtype, scale, zp, zpd, block, shape):
    lo = dequantize_affine(torch.full(shape, int(qdtype.qmin), dtype=qdtype.storage_dtype), qdtype, block, scale, zp,
                           zero_point_domain=zpd)
    hi = dequantize_affine(torch.full(shape, int(qdtype.qmax), dtype=qdtype.storage_dtype), qdtype, block, scale, zp,
                           zero_point_domain=zpd)
    return torch.minimum(lo, hi), torch.maximum(lo, hi)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("qdtype", [Q.int4, Q.int8, Q.uint4, Q.uint8], ids=lambda q: q.name)
@pytest.mark.parametrize("mapping,zpd", [(MappingType.SYMMETRIC, None), (MappingType.ASYMMETRIC, ZeroPointDomain.INT)],
                         ids=["symmetric", "asymmetric-int"])
def test_zero_is_exact_where_promised(seed, qdtype, mapping, zpd):
    x, block, _ = _random_case(seed)
    x.view(-1)[:: 3] = 0.0
    if zpd is None and not qdtype.signed:
        zpd = ZeroPointDomain.INT
    scale, zp = choose_qparams_affine(x, qdtype, block, mapping=mapping, zero_point_domain=zpd)
    deq = dequantize_affine(quantize_affine(x, qdtype, block, scale, zp, zero_point_domain=zpd), qdtype, block,
                            scale, zp, zero_point_domain=zpd)
    assert bool((deq[x == 0] == 0).all())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("qdtype", [Q.float8_e4m3fn, Q.float8_e5m2, Q.nf4, Q.fp4_e2m1], ids=lambda q: q.name)
def test_float_and_codebook_roundtrip(seed, qdtype):
    x, block, _ = _random_case(seed)
    scale, zp = choose_qparams_affine(x, qdtype, block)
    assert zp is None
    codes = quantize_affine(x, qdtype, block, scale)
    deq = dequantize_affine(codes, qdtype, block, scale)
    # The block's absmax element maps to the format's largest level: reproduced to the format's precision.
    rel = {"float8_e4m3fn": 2 ** -4, "float8_e5m2": 2 ** -3, "nf4": 1e-6, "fp4_e2m1": 1e-6}[qdtype.name]
    amax_idx = x.abs().argmax()
    assert abs(float(deq.view(-1)[amax_idx] - x.view(-1)[amax_idx])) <= rel * float(x.abs().max()) + 1e-6
    if qdtype.kind is QKind.CODEBOOK:
        assert int(codes.max()) <= 15
        # Nearest level: no other level is closer than the chosen one.
        levels = torch.tensor(qdtype.levels)
        scaled = x / _expand(scale, block, x.shape)
        dist = (scaled.unsqueeze(-1) - levels).abs()
        chosen = (scaled - levels[codes.long()]).abs()
        assert bool((chosen <= dist.min(-1).values + 1e-6).all())


def _expand(scale, block, shape):
    s = scale
    for d in range(len(shape)):
        s = s.repeat_interleave(block[d], d)
    return s


def test_codebook_ties_go_towards_zero():
    # nf4 levels 0.0 and 0.0796: their midpoint goes to 0.0; fp4 levels 2 and 3: 2.5 goes to 2, -2.5 to -2.
    nf4_mid = (Q.nf4.levels[7] + Q.nf4.levels[8]) / 2
    x = torch.tensor([[nf4_mid, -nf4_mid]], dtype=torch.float32)
    codes = quantize_affine(x, Q.nf4, (1, 2), torch.ones(1, 1))
    assert [Q.nf4.levels[c] for c in codes.view(-1).tolist()][0] == 0.0
    fp4 = quantize_affine(torch.tensor([[2.5, -2.5, 0.0, -0.0]]), Q.fp4_e2m1, (1, 4), torch.ones(1, 1))
    assert [Q.fp4_e2m1.levels[c] for c in fp4.view(-1).tolist()] == [2.0, -2.0, 0.0, 0.0]
    assert fp4.view(-1).tolist()[2:] == [0, 0]  # zero is always code 0 (+0), never -0


def test_float8_saturates():
    x = torch.tensor([[1e6, -1e6, 1.0]])
    codes = quantize_affine(x, Q.float8_e4m3fn, (1, 3), torch.ones(1, 1))
    assert codes.float().tolist() == [[448.0, -448.0, 1.0]]


def test_zero_range_block_gets_scale_one():
    x = torch.zeros(4, 32)
    x[1] = 3.5  # constant non-zero block
    for mapping, zpd in INT_SCHEMES:
        scale, zp = choose_qparams_affine(x, Q.int8, (1, 32), mapping=mapping, zero_point_domain=zpd)
        assert bool(torch.isfinite(scale).all()) and float(scale[0, 0]) == 1.0
        deq = dequantize_affine(quantize_affine(x, Q.int8, (1, 32), scale, zp, zero_point_domain=zpd), Q.int8,
                                (1, 32), scale, zp, zero_point_domain=zpd)
        assert bool(torch.isfinite(deq).all()) and bool((deq[0] == 0).all())
    scale, _ = choose_qparams_affine(x, Q.nf4, (1, 32))
    assert float(scale[0, 0]) == 1.0


def test_eps_floor_and_scale_dtype():
    x = torch.full((2, 8), 1e-12)
    scale, _ = choose_qparams_affine(x, Q.int8, (1, 8), eps=1e-5, scale_dtype=torch.bfloat16)
    assert scale.dtype == torch.bfloat16 and float(scale.min()) >= 1e-5 * 0.99


@pytest.mark.parametrize("spec,expected", [
    ("absmax", (-4.0, 4.0)), ("minmax", (-1.0, 4.0)), ("absmax,0.5", (-2.0, 2.0)),
    ("fixed,-2,3", (-2.0, 3.0)), ("fixed,-2,3,0.5", (-1.0, 1.5)),
])
def test_calibration_ranges(spec, expected):
    x = torch.tensor([[-1.0, 0.5, 2.0, 4.0]])
    lo, hi = parse_calibration(spec).block_range(x.view(1, 1, 1, 4), (1, 3))
    assert (float(lo), float(hi)) == expected


def test_rms_calibration_clips_outliers():
    x = torch.ones(1, 100)
    x[0, 0] = 100.0
    lo, hi = parse_calibration("rms,3").block_range(x.view(1, 1, 1, 100), (1, 3))
    rms = float(x.square().mean().sqrt())
    assert float(hi) == pytest.approx(3 * rms) and float(lo) == 1.0


@pytest.mark.parametrize("bad", ["", "median", "rms", "absmax,1.5", "fixed,3,2", "rms,x"])
def test_bad_calibration_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="calibration"):
        parse_calibration(bad)


def test_nan_and_inf_raise_unless_opted_out():
    x = torch.randn(4, 32)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"layer\.weight contains 1 NaN/Inf.*ModuleConfigs"):
        choose_qparams_affine(x, Q.int8, (1, 32), name="layer.weight")
    scale, _ = choose_qparams_affine(x, Q.int8, (1, 32), check_finite=False)
    assert bool(torch.isfinite(scale[:2]).all())
    x[2, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_affine(x, Q.int8, (1, 32), torch.ones(4, 1))


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.full((1, 4096), 0.3)
    scale = torch.ones(1, 1)
    a = quantize_affine(x, Q.int8, (1, 4096), scale, stochastic=True, generator=torch.Generator().manual_seed(0))
    b = quantize_affine(x, Q.int8, (1, 4096), scale, stochastic=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    assert set(a.unique().tolist()) == {0, 1}
    assert abs(a.float().mean().item() - 0.3) < 0.03  # E[code] = 0.3 (binomial sd 0.007)
    with pytest.raises(ValueError, match="generator"):
        quantize_affine(x, Q.int8, (1, 4096), scale, stochastic=True)


@pytest.mark.parametrize("qdtype,mapping,calibration", [
    (Q.int4, "symmetric", None), (Q.uint4, "asymmetric", None), (Q.int8, "asymmetric", "rms,2"),
    (Q.nf4, "symmetric", None), (Q.float8_e4m3fn, "symmetric", None)])
def test_partial_last_block_uses_its_real_values_only(qdtype, mapping, calibration):
    # K = 48 in groups of 32: the second group has 16 real values. Its qparams, codes and dequantized values
    # must equal those of the 16 columns quantized alone as one block, whatever the padding holds.
    x = torch.randn(4, 48) * 3 + 1
    kw = dict(mapping=mapping, calibration=calibration)
    scale, zp = choose_qparams_affine(x, qdtype, (1, 32), **kw)
    assert scale.shape == (4, 2)
    tail_scale, tail_zp = choose_qparams_affine(x[:, 32:], qdtype, (1, 16), **kw)
    assert torch.equal(scale[:, 1:], tail_scale)
    assert (zp is None and tail_zp is None) or torch.equal(zp[:, 1:], tail_zp)
    codes = quantize_affine(x, qdtype, (1, 32), scale, zp)
    assert codes.shape == x.shape
    tail = quantize_affine(x[:, 32:], qdtype, (1, 16), tail_scale, tail_zp)
    assert torch.equal(codes[:, 32:].view(torch.uint8), tail.view(torch.uint8))
    deq = dequantize_affine(codes, qdtype, (1, 32), scale, zp)
    assert deq.shape == x.shape
    assert torch.equal(deq[:, 32:], dequantize_affine(tail, qdtype, (1, 16), tail_scale, tail_zp))


def test_block_size_must_be_a_positive_int():
    with pytest.raises(ValueError, match="positive int"):
        choose_qparams_affine(torch.randn(4, 48), Q.int4, (1, 0))
    with pytest.raises(ValueError, match="nothing to quantize"):
        choose_qparams_affine(torch.randn(4, 0), Q.int4, (1, 32))


def test_tiny_weights_keep_their_precision():
    # A float32-eps floor on the scale (1.2e-7) would leave ~8 codes for a block of 1e-6 values.
    x = torch.randn(4, 64) * 1e-6
    scale, _ = choose_qparams_affine(x, Q.int8, (1, 64))
    deq = dequantize_affine(quantize_affine(x, Q.int8, (1, 64), scale), Q.int8, (1, 64), scale)
    assert (deq - x).abs().max() <= scale.max() / 2 * 1.001 and ((deq - x).norm() / x.norm()) < 0.01


@pytest.mark.parametrize("granularity,shape,expected", [
    (qk.PerTensor(), (8, 64), (8, 64)), (qk.PerAxis(0), (8, 64), (1, 64)), (qk.PerAxis(1), (8, 64), (8, 1)),
    (qk.PerRow(), (8, 64), (1, 64)), (qk.PerToken(), (2, 3, 64), (1, 1, 64)), (qk.PerGroup(32), (8, 64), (1, 32)),
    (qk.PerBlock((4, 16)), (8, 64), (4, 16)), (qk.PerBlock((16,)), (2, 8, 64), (1, 1, 16)),
])
def test_granularity_block_sizes(granularity, shape, expected):
    assert granularity.block_size(shape) == expected


def test_symmetric_no_clipping_err_reaches_both_ends():
    x = torch.tensor([[-1.0, 0.2, 3.0, 0.0]])
    scale, _ = choose_qparams_affine(x, Q.int8, (1, 4), mapping=MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    assert float(scale) == pytest.approx(3.0 / 127)
    codes = quantize_affine(x, Q.int8, (1, 4), scale)
    assert codes.tolist()[0][2] == 127


def test_schemes_the_format_cannot_express_are_refused():
    with pytest.raises(ValueError, match="symmetric by construction"):
        choose_qparams_affine(torch.randn(2, 8), Q.nf4, (1, 8), mapping=MappingType.ASYMMETRIC)
    with pytest.raises(ValueError, match="needs a zero point"):
        choose_qparams_affine(torch.randn(2, 8), Q.int4, (1, 8), mapping=MappingType.ASYMMETRIC,
                              zero_point_domain=ZeroPointDomain.NONE)


@pytest.mark.parametrize("make", [lambda: qk.PerGroup(True), lambda: qk.PerGroup(1.5), lambda: qk.PerBlock(("64",)),
                                  lambda: qk.PerBlock((1.5, 2)), lambda: qk.PerAxis(1.5), lambda: qk.PerAxis(True)])
def test_granularities_take_real_ints_only(make):
    with pytest.raises(ValueError, match="int"):
        make()
