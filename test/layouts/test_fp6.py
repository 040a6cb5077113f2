"""FP6Layout and the fp6 qdtypes: the 64 values of each format, pinned bytes (four codes in three bytes), rounding
and saturation, byte arithmetic, slices, configs, quality against int4."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.core import qdtypes as Q

from ..common import sqnr


def test_fp6_values_follow_the_ocp_formats():
    e3m2, e2m3 = Q.fp6_e3m2.levels, Q.fp6_e2m3.levels
    assert len(e3m2) == len(e2m3) == 64 and Q.fp6_e3m2.qmax == 63
    # e3m2: bias 3, subnormal step 2^-4, largest (1 + 3/4) 2^4; e2m3: bias 1, subnormal step 1/8, largest 1.875 * 4
    assert e3m2[1] == 0.0625 and e3m2[4] == 0.25 and e3m2[12] == 1.0 and e3m2[31] == 28.0
    assert e2m3[1] == 0.125 and e2m3[8] == 1.0 and e2m3[9] == 1.125 and e2m3[31] == 7.5
    assert e3m2[32 + 12] == -1.0 and e2m3[63] == -7.5


def test_packed_bytes_pinned():
    # Note [FP6 bit layout]: codes 1.0 = 0b001100, -1.0 = 0b101100, 0, 28.0 = 0b011111 -> 0x0C 0x0B 0x7C
    w = torch.zeros(2, 8)
    w[0, :4] = torch.tensor([1.0, -1.0, 0.0, 28.0])  # absmax 28 = e3m2's largest: scale 1
    w[1, :2] = torch.tensor([2.0, 2.25])              # scale 2.25 / 28
    aqt = qk.quantize_weight(w, Q.fp6_e3m2, qk.PerRow(), qk.FP6Layout())
    assert aqt.qdata.dtype == torch.uint8 and aqt.qdata.shape == (2, 6)
    assert aqt.qdata[0].tolist() == [0x0C, 0x0B, 0x7C, 0, 0, 0]
    codes = qk.FP6Layout().unpack(aqt).qdata
    assert codes[1, :2].tolist() == [0b011110, 0b011111]  # 2.0 / s = 24.9 -> 24.0; 2.25 / s = 28.0


@pytest.mark.parametrize("qdtype", [Q.fp6_e3m2, Q.fp6_e2m3], ids=lambda q: q.name)
def test_every_value_round_trips_exactly(qdtype):
    levels = torch.tensor(qdtype.levels).reshape(1, 64)
    aqt = qk.quantize_weight(levels, qdtype, qk.PerRow(), qk.FP6Layout(), scale_dtype=torch.float32)
    assert aqt.scale.item() == 1.0 and torch.equal(aqt.dequantize(), levels)
    expected = torch.arange(64)
    expected[32] = 0  # -0 is stored as +0
    assert torch.equal(qk.FP6Layout().unpack(aqt).qdata.long(), expected.reshape(1, 64))


def test_values_past_the_largest_saturate():
    w = torch.tensor([[10.0, -100.0, 0.1, 1.0]])
    s = torch.tensor([[1.0]])
    codes = qk.quantize_affine(w, Q.fp6_e2m3, (1, 4), s)
    assert qk.dequantize_affine(codes, Q.fp6_e2m3, (1, 4), s).tolist() == [[7.5, -7.5, 0.125, 1.0]]


def test_stored_bytes_match_format_arithmetic():
    n, k = 16, 96
    aqt = qk.quantize_weight(torch.randn(n, k), Q.fp6_e3m2, qk.PerGroup(32), qk.FP6Layout(), scale_dtype=torch.bfloat16)
    assert aqt.packed_nbytes() * 8 == n * k * 6 + n * (k // 32) * 16  # 6 bits per weight + a bf16 scale per 32


def test_slices_along_k_cut_whole_three_byte_units():
    aqt = qk.quantize_weight(torch.randn(8, 100), Q.fp6_e3m2, qk.PerRow(), qk.FP6Layout())
    part = aqt[:, 4:12]
    assert part.qdata.shape == (8, 6) and part.qdata.data_ptr() == aqt.qdata.data_ptr() + 3
    assert torch.equal(part.dequantize(), aqt.dequantize()[:, 4:12])
    with pytest.raises(ValueError, match="multiples of 4"):
        aqt[:, 2:10]


@pytest.mark.parametrize("bad", [dict(ebits=4), dict(ebits=3, group_size=0)])
def test_config_refuses_bad_arguments(bad):
    with pytest.raises(ValueError):
        qk.FP6WeightOnlyConfig(**bad)


@pytest.mark.parametrize("config,floor_db", [(qk.FP6WeightOnlyConfig(), 24.0),
                                             (qk.FP6WeightOnlyConfig(ebits=2), 29.0),
                                             (qk.FP6WeightOnlyConfig(ebits=2, group_size=32), 29.0)])
def test_configs_quantize_and_quality(config, floor_db):
    # Output SQNR measured 26.4 (e3m2 per row), 31.9 (e2m3 per row), 32.0 dB (e2m3 g32); IntxWeightOnlyConfig(bits=4,
    # PerGroup(32)) measures 23.6 dB on this layer.
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(8, 64)
    ref = lin(x).detach()
    report = qk.quantize_(lin, config)
    assert len(report.quantized) == 1 and isinstance(lin.weight.qlayout, qk.FP6Layout)
    assert sqnr(ref, lin(x).detach()) >= floor_db
