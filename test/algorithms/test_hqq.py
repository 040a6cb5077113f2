"""HQQ qparams (torchqkit/algorithms/hqq.py): starts at round-to-nearest, beats it on weights with outliers,
handles partial blocks from their real values only, and reaches quantize_ through the configs' algorithm."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.algorithms import hqq as hqq_module
from torchqkit.algorithms import hqq_qparams
from torchqkit.core.primitives import code_midpoint
from torchqkit.core import (MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine,
                            quantize_affine)
from torchqkit.core.qdtype import INT, int3, int4, nf4, uint4

from ..common import MLP, sqnr

ASYM, FLOAT, INT_ZP = MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT, ZeroPointDomain.INT


def outlier_weight(n: int, k: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Gaussian weights (std 0.02) with 4 outliers of magnitude 0.2 (10 sigma) per row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    cols = torch.randint(0, k, (n, 4), generator=g)
    w.scatter_(1, cols, torch.randn(n, 4, generator=g).sign() * 0.2)
    return w.to(dtype)


def roundtrip(w, qdtype, block_size, scale, zero, zpd=FLOAT):
    codes = quantize_affine(w, qdtype, block_size, scale, zero, zero_point_domain=zpd)
    return dequantize_affine(codes, qdtype, block_size, scale, zero, zero_point_domain=zpd)


# ------------------------------------------------------------------------------------------ hqq_qparams

@pytest.mark.parametrize("qdtype,block_size,zpd,dtype", [
    (uint4, (1, 64), FLOAT, torch.float32),
    (uint4, (1, 32), FLOAT, torch.bfloat16),
    (int3, (1, 96), FLOAT, torch.float32),
    (int4, (1, 64), INT_ZP, torch.float32),
    (int3, (4, 32), FLOAT, torch.float32),
    (uint4, (1, 80), FLOAT, torch.float32),  # K = 192: two groups of 80 and a partial one of 32
    (int3, (5, 64), FLOAT, torch.float32),  # partial along both dims
])
def test_iteration_zero_is_round_to_nearest_with_a_whole_code_zero(qdtype, block_size, zpd, dtype):
    # The start (Note [HQQ]): round-to-nearest's min-max scale, its zero point rounded to a whole code.
    w = outlier_weight(32, 192, dtype=dtype)
    got_scale, got_zero = hqq_qparams(w, qdtype, block_size, zero_point_domain=zpd, iters=0)
    scale, zero = choose_qparams_affine(w, qdtype, block_size, mapping=ASYM, zero_point_domain=zpd)
    assert got_scale.dtype == scale.dtype and got_zero.dtype == zero.dtype and got_zero.shape == zero.shape
    torch.testing.assert_close(got_scale, scale, rtol=0, atol=0)
    if zpd is FLOAT:
        # In the code domain (x ~ (q - z) s): z is a whole code, the rounded round-to-nearest one.
        mid, s = code_midpoint(qdtype), scale.float()
        got_code, rtn_code = mid - got_zero.float() / s, mid - zero.float() / s
        tol = 0.05 if dtype == torch.bfloat16 else 1e-4  # bf16 stores z_f = (mid - z) s to 8 bits
        assert (got_code - got_code.round()).abs().max() < tol
        differs = (got_code.round() - rtn_code.round()).abs()
        # bf16 rounds the reference zero before we round it: a code at a .5 tie may go either way.
        assert differs.max() <= (1 if dtype == torch.bfloat16 else 0) and (differs > 0).float().mean() < 0.02
    else:
        torch.testing.assert_close(got_zero, zero, rtol=0, atol=0)


@pytest.mark.parametrize("qdtype,group_size,dtype", [
    (uint4, 32, torch.float32), (uint4, 64, torch.float32), (uint4, 128, torch.float32), (int3, 64, torch.float32),
    (uint4, 64, torch.bfloat16),  # bfloat16 scale and zero point keep the gain
], ids=["uint4-g32", "uint4-g64", "uint4-g128", "int3-g64", "uint4-g64-bf16"])
def test_hqq_beats_rtn_on_weights_with_outliers(qdtype, group_size, dtype):
    w = outlier_weight(256, 512, dtype=dtype)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    bs = (1, group_size)
    rtn = roundtrip(w, qdtype, bs, *choose_qparams_affine(w, qdtype, bs, mapping=ASYM, zero_point_domain=FLOAT))
    hqq = roundtrip(w, qdtype, bs, *hqq_qparams(w, qdtype, bs))
    # Measured gains: 0.1-0.5 dB on the weights, 0.04-0.5 dB on the outputs.
    assert sqnr(w, hqq) >= sqnr(w, rtn) + 0.1, (sqnr(w, hqq), sqnr(w, rtn))
    w, rtn, hqq = w.float(), rtn.float(), hqq.float()
    ref = F.linear(x, w)
    assert sqnr(ref, F.linear(x, hqq)) > sqnr(ref, F.linear(x, rtn))


def test_the_kept_zeros_never_raise_the_mean_abs_error_of_the_start():
    # The whole tensor keeps the iteration with the lowest mean |error|, the start (iteration 0) included.
    w = outlier_weight(64, 256, seed=3)
    bs = (1, 32)
    start = roundtrip(w, uint4, bs, *hqq_qparams(w, uint4, bs, iters=0))
    hqq = roundtrip(w, uint4, bs, *hqq_qparams(w, uint4, bs))
    assert (w - hqq).abs().mean() < (w - start).abs().mean()


def test_mean_residual_equals_the_clamped_shrink():
    # The shortcut (no power below c = beta^(-1/(2-p))) against e - shrink_p(e) computed directly,
    # on errors both below and above c (0.17 at the defaults).
    g = torch.Generator().manual_seed(0)
    e = torch.randn(64, 32, generator=g) * torch.tensor([0.01, 0.5]).repeat_interleave(32)[:, None]
    p, beta = 0.7, 10.0
    a = e.abs()
    shrunk = torch.sign(e) * torch.relu(a - (a + 1e-8).pow(p - 1) / beta)
    want = (e - shrunk).sum(-1, keepdim=True)
    torch.testing.assert_close(hqq_module._mean_residual(e, p, beta), want, rtol=1e-5, atol=1e-6)


def test_lp_norm_shapes_the_zero_point_on_large_errors():
    # Weights of magnitude ~1 at 2 bits have errors above c, where the lp shrinkage acts: p changes z.
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    _, z_07 = hqq_qparams(w, INT[2], (1, 64), lp_norm=0.7)
    _, z_10 = hqq_qparams(w, INT[2], (1, 64), lp_norm=1.0)
    assert not torch.equal(z_07, z_10)


def test_integer_zero_points_are_codes_in_range():
    w = outlier_weight(32, 128) + 0.05  # ranges that mostly exclude 0
    scale, zero = hqq_qparams(w, int4, (1, 32), zero_point_domain=INT_ZP)
    assert zero.dtype == int4.storage_dtype and int(zero.min()) >= int4.qmin and int(zero.max()) <= int4.qmax
    rtn = choose_qparams_affine(w, int4, (1, 32), mapping=ASYM, zero_point_domain=INT_ZP)
    assert torch.equal(scale, rtn[0])  # HQQ moves only the zero point
    # Rounding the optimised zero to a code keeps it near round-to-nearest's (measured: equal SQNR).
    assert sqnr(w, roundtrip(w, int4, (1, 32), scale, zero, INT_ZP)) >= sqnr(w, roundtrip(w, int4, (1, 32), *rtn, INT_ZP)) - 0.05


def test_deterministic_and_independent_of_chunking(monkeypatch):
    w = outlier_weight(96, 320, seed=7)
    first = hqq_qparams(w, uint4, (1, 32))
    assert all(torch.equal(a, b) for a, b in zip(first, hqq_qparams(w, uint4, (1, 32))))
    # Each block is its own problem: processing 3 blocks at a time must give the same bits.
    monkeypatch.setattr(hqq_module, "_CHUNK", 3 * 32)
    assert all(torch.equal(a, b) for a, b in zip(first, hqq_qparams(w, uint4, (1, 32))))


@pytest.mark.parametrize("kwargs,match", [
    ({"qdtype": nf4}, "integer codes"),
    ({"zero_point_domain": ZeroPointDomain.NONE}, "zero point"),
    ({"lp_norm": 1.5}, "lp_norm"),
    ({"kappa": 0.9}, "kappa"),
    ({"block_size": (64,)}, "block_size"),
])
def test_bad_arguments_raise(kwargs, match):
    args = {"qdtype": uint4, "block_size": (1, 64), **kwargs}
    with pytest.raises(ValueError, match=match):
        hqq_qparams(torch.randn(4, 64), args.pop("qdtype"), args.pop("block_size"), **args)


# ------------------------------------------------------------------------------------------ partial blocks

def test_partial_group_uses_its_real_values_only():
    # K = 200 in groups of 64: three whole groups and a tail of 8. The tail is shifted to all-positive
    # values, so padding counted as real zeros would move its minimum (and its qparams).
    w = outlier_weight(24, 200, seed=11)
    w[:, 192:] = w[:, 192:].abs() + 0.3
    scale, zero = hqq_qparams(w, uint4, (1, 64))
    assert scale.shape == zero.shape == (24, 4)
    head = hqq_qparams(w[:, :192], uint4, (1, 64))
    assert torch.equal(scale[:, :3], head[0]) and torch.equal(zero[:, :3], head[1])
    tail = hqq_qparams(w[:, 192:], uint4, (1, 8))
    # Same arithmetic on the same values; only the order of a sum over 8 reals + 56 masked zeros may differ.
    torch.testing.assert_close(scale[:, 3:], tail[0], rtol=0, atol=0)
    torch.testing.assert_close(zero[:, 3:], tail[1], rtol=1e-6, atol=1e-7)
    padded = hqq_qparams(F.pad(w, (0, 56)), uint4, (1, 64))
    assert not torch.allclose(zero[:, 3:], padded[1][:, 3:])


def test_partial_blocks_along_both_dims():
    w = outlier_weight(10, 70, seed=2)
    scale, zero = hqq_qparams(w, int3, (4, 32))
    assert scale.shape == zero.shape == (3, 3)
    # The start of the last (2 rows x 6 columns) block comes from its real values only. (Later iterations
    # stop for the whole tensor at once, so they depend on the other blocks too, never on the padding.)
    start_scale, start_zero = hqq_qparams(w, int3, (4, 32), iters=0)
    corner = hqq_qparams(w[8:, 64:], int3, (2, 6), iters=0)
    torch.testing.assert_close(start_scale[2:, 2:], corner[0], rtol=0, atol=0)
    torch.testing.assert_close(start_zero[2:, 2:], corner[1], rtol=1e-6, atol=1e-7)


def test_partial_groups_end_to_end():
    w = outlier_weight(48, 200, seed=4)
    q_hqq = qk.quantize_weight(w, uint4, qk.PerGroup(64), qk.PlainLayout(), mapping=ASYM,
                               zero_point_domain=FLOAT, algorithm="hqq")
    q_rtn = qk.quantize_weight(w, uint4, qk.PerGroup(64), qk.PlainLayout(), mapping=ASYM,
                               zero_point_domain=FLOAT)
    scale, zero = hqq_qparams(w, uint4, (1, 64))
    assert torch.equal(q_hqq.dequantize(), roundtrip(w, uint4, (1, 64), scale, zero))
    assert sqnr(w, q_hqq.dequantize()) > sqnr(w, q_rtn.dequantize())


# ------------------------------------------------------------------------------------------ configs

HQQ_CONFIGS = [
    qk.Int4WeightOnlyConfig(group_size=64, algorithm="hqq"),
    qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(64), algorithm="hqq"),
    qk.IntxWeightOnlyConfig(bits=5, granularity=qk.PerAxis(0), algorithm="hqq"),
]


@pytest.mark.parametrize("config", HQQ_CONFIGS, ids=lambda c: c.describe())
def test_config_json_round_trip_and_describe(config):
    back = qk.config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert back == config and back.algorithm == "hqq"
    assert config.describe().endswith(" hqq")


def test_intx_hqq_is_asymmetric_with_a_float_zero_point():
    config = qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(64), algorithm="hqq")
    assert config.mapping is MappingType.ASYMMETRIC
    model = torch.nn.Sequential(torch.nn.Linear(128, 32, bias=False))
    qk.quantize_(model, config)
    w = model[0].weight
    assert isinstance(w.qlayout, qk.PackedIntxLayout) and ZeroPointDomain(w.zero_point_domain) is FLOAT
    # The layout's linear (the packed-intx kernel, float zero point) against its own dequantization;
    # fp32 accumulation in another order: ~1e-6 apart on outputs of magnitude ~1.
    x = torch.randn(5, 128)
    with torch.no_grad():
        torch.testing.assert_close(model(x), F.linear(x, w.dequantize()), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="symmetric_no_clipping_err"):
        qk.IntxWeightOnlyConfig(mapping="symmetric_no_clipping_err", algorithm="hqq")


@pytest.mark.parametrize("cls", [qk.Int4WeightOnlyConfig, qk.IntxWeightOnlyConfig])
def test_unknown_algorithm_raises(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: algorithm must be one of \('rtn', 'hqq'\), got 'gptq'"):
        cls(algorithm="gptq")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        qk.quantize_weight(torch.randn(8, 64), uint4, qk.PerGroup(64), qk.PlainLayout(), algorithm="awq")


def test_hqq_refuses_rtn_only_options():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="asymmetric"):
        qk.quantize_weight(w, int4, qk.PerGroup(64), qk.PlainLayout(), algorithm="hqq")
    with pytest.raises(ValueError, match="calibration"):
        qk.quantize_weight(w, int4, qk.PerGroup(64), qk.PlainLayout(), mapping=ASYM, calibration="rms,3",
                           algorithm="hqq")


RTN_CASES = [  # config, qdtype, the mapping and zero point domain its handler passes
    (qk.Int4WeightOnlyConfig(group_size=32), uint4, MappingType.ASYMMETRIC, FLOAT),
    (qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(32)), int3, MappingType.SYMMETRIC, None),
]


@pytest.mark.parametrize("config,qdtype,mapping,zpd", RTN_CASES, ids=lambda c: type(c).__name__)
def test_default_stays_round_to_nearest_bit_for_bit(config, qdtype, mapping, zpd):
    assert config.algorithm == "rtn"
    torch.manual_seed(0)
    model = MLP(dim=64, hidden=96, out=32)
    w = model.up.weight.detach().clone()
    qk.quantize_(model, config)
    plain = model.up.weight.qlayout.unpack(model.up.weight)
    scale, zero = choose_qparams_affine(w, qdtype, (1, 32), mapping=mapping, zero_point_domain=zpd)
    codes = quantize_affine(w, qdtype, (1, 32), scale, zero, zero_point_domain=zpd)
    assert torch.equal(plain.qdata, codes) and torch.equal(plain.scale, scale)
    assert (plain.zero_point is None) == (zero is None)
    assert zero is None or torch.equal(plain.zero_point, zero)


@pytest.mark.parametrize("hqq_config", [
    qk.Int4WeightOnlyConfig(group_size=32, algorithm="hqq"),
    qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(64), algorithm="hqq"),
    qk.IntxWeightOnlyConfig(bits=2, granularity=qk.PerRow(), algorithm="hqq"),
], ids=lambda c: c.describe())
def test_quantize_mlp_with_hqq_is_closer_to_float(hqq_config):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(32, 128)
    rtn_config = dataclasses.replace(hqq_config, algorithm="rtn")
    if isinstance(hqq_config, qk.IntxWeightOnlyConfig):
        rtn_config = dataclasses.replace(rtn_config, mapping=MappingType.ASYMMETRIC)  # HQQ's starting point
    outputs = {}
    for config in (rtn_config, hqq_config):
        qmodel = copy.deepcopy(model)
        report = qk.quantize_(qmodel, config)
        assert len(report.quantized) == 2 and report.skipped == []
        with torch.no_grad():
            outputs[config.algorithm] = qmodel(x)
    with torch.no_grad():
        ref = model(x)
    # Measured: int4 g32 21.8 -> 23.0 dB, int3 g64 14.2 -> 15.6, int2 per-channel 7.4 -> 7.7.
    assert sqnr(ref, outputs["hqq"]) >= sqnr(ref, outputs["rtn"]) + 0.2
