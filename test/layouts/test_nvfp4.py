"""NVFP4Layout: pinned bytes, the float8 block scales and their global scale, refused scales, byte arithmetic,
partial blocks, configs, NVFP4 activations, quality against MXFP4."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.core.primitives import split_float8_scales

from ..common import sqnr


def _nvfp4(w):
    return qk.quantize_weight(w, Q.fp4_e2m1, qk.PerGroup(16), qk.NVFP4Layout(), scale_dtype=torch.float32,
                              scale_rounding="float8_e4m3")


def test_packed_bytes_pinned():
    w = torch.zeros(3, 16)
    w[0, :3] = torch.tensor([6.0, -1.0, 0.5])  # amax 6: block scale 1 = E / G with G = 2^8 (1 * 2^8 <= 448 < 2^9)
    w[1, :2] = torch.tensor([3.0, 1.5])        # amax 3: E = 128, block scale 0.5: codes of 6.0 and 3.0
    w[2, :2] = torch.tensor([0.9, 0.3])        # amax 0.9: 0.15 * 256 = 38.4 -> e4m3 40 (0x62): scale 0.15625
    aqt = _nvfp4(w)
    assert aqt.qdata.dtype == torch.uint8 and aqt.qdata.shape == (3, 8)
    # byte j = code[2j + 1] << 4 | code[2j]; e2m1 codes 6.0 = 0x7, -1.0 = 0xA, 0.5 = 0x1, 3.0 = 0x5
    assert aqt.qdata[0, :2].tolist() == [0xA7, 0x01] and aqt.qdata[1, :1].tolist() == [0x57]
    # 0.9 / 0.15625 = 5.76 -> 6.0 (0x7); 0.3 / 0.15625 = 1.92 -> 2.0 (0x4)
    assert aqt.qdata[2, :1].tolist() == [0x47]
    assert aqt.scale.dtype == torch.float8_e4m3fn
    assert aqt.scale.view(torch.uint8).flatten().tolist() == [0x78, 0x70, 0x62]
    assert aqt.global_scale.dtype == torch.float32 and aqt.global_scale.tolist() == [256.0]
    assert aqt.dequantize()[2, :2].tolist() == [0.9375, 0.3125]


def test_global_scale_keeps_the_largest_block_in_the_top_binade():
    # Note [Float8 block scales]: the largest block's E lies in (224, 448], whatever the weight's magnitude.
    for magnitude in (1e-30, 1e-3, 1.0, 1e3, 1e30):
        aqt = _nvfp4(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * magnitude)
        e = aqt.scale.float()
        g = float(aqt.global_scale)
        assert 224 < float(e.max()) <= 448 and g == 2.0 ** round(torch.log2(torch.tensor(g)).item())
        assert torch.equal(qk.NVFP4Layout().unpack(aqt).scale, e / g)


def test_all_zero_weight_gets_the_smallest_scale_and_zero_codes():
    aqt = _nvfp4(torch.zeros(4, 32))
    # E = 2^-9 (e4m3's smallest subnormal) under G = 2^8 (the global scale of amax 1): block scale 2^-17, which
    # pack stores as E = 2^8 under G = 2^25 (the same quotient, the largest E in e4m3's top binade)
    assert qk.NVFP4Layout().unpack(aqt).scale.unique().tolist() == [2.0 ** -17]
    assert aqt.scale.view(torch.uint8).unique().tolist() == [0x78] and aqt.global_scale.tolist() == [2.0 ** 25]
    assert not aqt.qdata.any() and not aqt.dequantize().any()


@pytest.mark.parametrize("bad", [[[1.0, 3.0 / 7]], [[1.0, 0.0]], [[1.0, float("nan")]]],
                         ids=["not-e4m3", "zero", "nan"])
def test_pack_refuses_scales_that_are_not_float8_under_a_power_of_two(bad):
    with pytest.raises(ValueError, match="NVFP4"):
        split_float8_scales(torch.tensor(bad), "NVFP4Layout.pack")


def test_stored_bytes_match_format_arithmetic():
    n, k = 64, 256
    aqt = _nvfp4(torch.randn(n, k))
    # e2m1 codes + one 8-bit e4m3 scale per 16 weights + one float32 per tensor: 4.5 bits per weight
    assert aqt.packed_nbytes() * 8 == n * k * 4 + n * (k // 16) * 8 + 32


def test_partial_block_and_slices_keep_the_global_scale():
    w = torch.randn(24, 200)  # 12 whole blocks and one of 8
    aqt = _nvfp4(w)
    assert aqt.qdata.shape == (24, 104) and aqt.scale.shape == (24, 13)
    part = aqt[:, 16:48]
    assert part.global_scale.data_ptr() == aqt.global_scale.data_ptr()
    assert torch.equal(part.dequantize(), aqt.dequantize()[:, 16:48])


@pytest.mark.parametrize("config,floor_db", [(qk.NVFP4WeightOnlyConfig(), 18.0),
                                             (qk.NVFP4DynamicActivationNVFP4WeightConfig(), 14.0)])
def test_configs_quantize_and_quality(config, floor_db):
    # Output SQNR measured 19.7 (weights only) / 17.3 dB (activations too) on this layer, where MXFP4 measures 16.0.
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(8, 64)
    ref = lin(x).detach()
    report = qk.quantize_(lin, config)
    assert len(report.quantized) == 1 and isinstance(lin.weight.qlayout, qk.NVFP4Layout)
    assert sqnr(ref, lin(x).detach()) >= floor_db


def test_nvfp4_beats_mxfp4_on_gaussian_weights():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(2))
    mx = qk.quantize_weight(w, Q.fp4_e2m1, qk.PerGroup(32), qk.MXLayout(), scale_rounding="power_of_two")
    assert sqnr(w, _nvfp4(w).dequantize()) > sqnr(w, mx.dequantize()) + 1.0


def test_nvfp4_activations_non_finite_rows_stay_their_own():
    act = qk.ActivationQuantSpec(Q.fp4_e2m1, qk.PerGroup(16))
    x = torch.randn(3, 32)
    x[1, 5] = float("inf")
    y = act.fake_quantize(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    clean = act.fake_quantize(x[[0, 2]])
    assert torch.equal(y[[0, 2]], clean)  # the per-call scale is taken over the finite values only


@pytest.mark.parametrize("spec", [dict(granularity=qk.PerGroup(32)), dict(granularity=qk.PerToken()),
                                  dict(granularity=qk.PerGroup(16), static_scale=0.1)])
def test_nvfp4_activation_spec_refuses_other_shapes(spec):
    with pytest.raises(ValueError, match=r"fp4_e2m1 activations are NVFP4: PerGroup\(16\)"):
        qk.ActivationQuantSpec(Q.fp4_e2m1, **spec)


@pytest.mark.parametrize("kwargs,match", [(dict(scale_dtype=torch.bfloat16), "float32 quotients E / G"),
                                          (dict(scale_dtype=torch.float32, eps=1e-6), "eps does not apply"),
                                          (dict(scale_dtype=torch.float32, qdtype=Q.int4), "float8 and codebook")])
def test_float8_block_scales_refuse_what_they_cannot_be(kwargs, match):
    qdtype = kwargs.pop("qdtype", Q.fp4_e2m1)
    with pytest.raises(ValueError, match=match):
        qk.choose_qparams_affine(torch.ones(2, 16), qdtype, (1, 16), scale_rounding="float8_e4m3", **kwargs)
