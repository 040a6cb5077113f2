"""MXLayout: pinned bytes, E8M0 codec, byte arithmetic, configs, supports() reasons, quality."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.layouts.mx import _from_e8m0, _to_e8m0

from ..common import sqnr


def _mx(w, qdtype):
    return qk.quantize_weight(w, qdtype, qk.PerGroup(32), qk.MXLayout(), scale_rounding="power_of_two")


def test_mxfp4_packed_bytes_pinned():
    w = torch.zeros(3, 32)
    w[0, :4] = torch.tensor([1.0, -1.0, 6.0, 0.5])   # amax 6 -> X = 2^0, E8M0 127
    w[1, :4] = torch.tensor([4.0, -4.0, 24.0, 2.0])  # amax 24 -> X = 2^2, E8M0 129; same codes
    w[2, :2] = torch.tensor([7.5, 0.75])             # amax 7.5 -> X = 1: 7.5 saturates to 6; 0.75 ties to 0.5
    aqt = _mx(w, Q.fp4_e2m1)
    # byte j = code[2j + 1] << 4 | code[2j]; codes: 1.0 = 0x2, -1.0 = 0xA, 6.0 = 0x7, 0.5 = 0x1
    assert aqt.qdata.dtype == torch.uint8 and aqt.qdata.shape == (3, 16)
    assert aqt.qdata[0, :3].tolist() == [0xA2, 0x17, 0x00] and aqt.qdata[1, :3].tolist() == [0xA2, 0x17, 0x00]
    assert aqt.qdata[2, :2].tolist() == [0x17, 0x00]
    assert aqt.scale.dtype == torch.uint8 and aqt.scale.flatten().tolist() == [127, 129, 127]
    assert aqt.dequantize()[2, :2].tolist() == [6.0, 0.5]


def test_mxfp8_packed_bytes_pinned():
    w = torch.zeros(2, 32)
    w[0, :3] = torch.tensor([448.0, -1.0, 0.5])  # amax 448 -> X = 2^(8-8) = 1, E8M0 127
    w[1, :2] = torch.tensor([1.0, -0.5])         # amax 1 -> X = 2^-8, E8M0 119; 1.0 / X = 256 = 0x78
    aqt = _mx(w, Q.float8_e4m3fn)
    assert aqt.qdata.dtype == torch.float8_e4m3fn and aqt.qdata.shape == (2, 32)
    assert aqt.qdata.view(torch.uint8)[0, :3].tolist() == [0x7E, 0xB8, 0x30]
    assert aqt.qdata.view(torch.uint8)[1, :2].tolist() == [0x78, 0xF0]
    assert aqt.scale.flatten().tolist() == [127, 119]


def test_e8m0_codec_exact_over_every_code():
    e = torch.arange(255, dtype=torch.uint8)
    values = _from_e8m0(e)
    expected = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64).float()
    assert torch.equal(values, expected) and values[0].item() == 2.0 ** -127
    assert torch.equal(_to_e8m0(values), e)
    assert torch.isnan(_from_e8m0(torch.tensor([255], dtype=torch.uint8))).all()


@pytest.mark.parametrize("bad", [3.0, 0.0, -1.0, float("inf")])
def test_pack_refuses_scales_that_are_not_powers_of_two(bad):
    with pytest.raises(ValueError, match="scale_rounding='power_of_two'") as err:
        _to_e8m0(torch.tensor([[1.0, bad]]))
    assert f"e.g. [{bad}]" in str(err.value)  # the offending scale is named, infinity included


@pytest.mark.parametrize("qdtype,bits_per_weight", [(Q.fp4_e2m1, 4), (Q.float8_e4m3fn, 8)])
def test_stored_bytes_match_format_arithmetic(qdtype, bits_per_weight):
    n, k = 64, 256
    aqt = _mx(torch.randn(n, k), qdtype)
    # elements + one 8-bit E8M0 scale per 32 weights: MXFP4 4.25 bits/weight, MXFP8 8.25
    assert aqt.packed_nbytes() * 8 == n * k * bits_per_weight + n * (k // 32) * 8


def test_dequantize_compiled_is_bit_exact():
    aqt = _mx(torch.randn(16, 64) * 1e-30, Q.fp4_e2m1)  # tiny values: scales down to ~2^-102
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: t.dequantize(), fullgraph=True)(aqt)
    assert torch.equal(compiled, aqt.dequantize())


@pytest.mark.parametrize("config,floor_db", [(qk.MXFP8WeightOnlyConfig(), 23.0),
                                             (qk.MXFP8WeightOnlyConfig(element_dtype="float8_e5m2"), 20.0),
                                             (qk.MXFP4WeightOnlyConfig(), 14.0)])
def test_configs_quantize_and_quality(config, floor_db):
    # Output SQNR measured 25.2 / 22.0 / 16.0 dB. nn.Linear's uniform init puts amax just under a power of
    # two (1/8 for K = 64), where the spec's floor() makes amax / X ~ 511 and e4m3 saturates at 448:
    # the spec's clipping, visible here as ~6 dB below float8 per-row.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 32))
    x = torch.randn(8, 128)
    ref = model(x)
    report = qk.quantize_(model, config)
    assert len(report.quantized) == 2 and isinstance(model[0].weight.qlayout, qk.MXLayout)
    with torch.no_grad():
        assert sqnr(ref, model(x)) >= floor_db
    assert qk.config_from_dict(config.to_dict()) == config


def test_partial_last_block_is_padded_inside():
    model = nn.Sequential(nn.Linear(48, 16), nn.Linear(64, 16))  # 48 = one MX block and a half
    report = qk.quantize_(model, qk.MXFP4WeightOnlyConfig(), strict=True)
    assert len(report.quantized) == 2
    assert model[0].weight.qdata.shape == (16, 32) and model[0].weight.scale.shape == (16, 2)


@pytest.mark.parametrize("qdtype,block,zpd,match", [
    (Q.int4, (1, 32), qk.ZeroPointDomain.NONE, "not int4"),
    (Q.fp4_e2m1, (1, 64), qk.ZeroPointDomain.NONE, r"blocks of \(1, 32\)"),
    (Q.float8_e4m3fn, (1, 32), qk.ZeroPointDomain.FLOAT, "no zero point"),
])
def test_supports_gives_reasons(qdtype, block, zpd, match):
    reason = qk.MXLayout().supports(qk.layouts.WeightFormat.of(qdtype, block, (16, 64), zpd))
    assert reason is not None and __import__("re").search(match, reason)


def test_slice_along_k_keeps_whole_mx_blocks():
    aqt = _mx(torch.randn(8, 96), Q.fp4_e2m1)
    part = aqt[:, 32:64]
    assert part.qdata.untyped_storage().data_ptr() == aqt.qdata.untyped_storage().data_ptr()
    assert torch.equal(part.dequantize(), aqt.dequantize()[:, 32:64])
    with pytest.raises(ValueError, match="multiples of 32"):
        aqt[:, 0:16]
