"""Float8Layout: pinned bytes, byte arithmetic, per-block scales, which linear path runs, configs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchqkit as qk
from torchqkit.core import qdtypes as Q

from ..common import sqnr

aten = torch.ops.aten


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _f8(w, qdtype=Q.float8_e4m3fn, granularity=qk.PerRow(), **kw):
    return qk.quantize_weight(w, qdtype, granularity, qk.Float8Layout(), scale_dtype=torch.float32, **kw)


def test_e4m3_bytes_pinned():
    aqt = _f8(torch.tensor([[2.0, -1.0, 0.5, 0.0]]))  # scale 2 / 448: codes 448, -224, 112, 0
    # e4m3fn: sign | eeee (bias 7) | mmm. 448 = 1.75 * 2^8, 224 = 1.75 * 2^7, 112 = 1.75 * 2^6
    assert aqt.qdata.dtype == torch.float8_e4m3fn
    assert aqt.qdata.view(torch.uint8).tolist() == [[0x7E, 0xF6, 0x6E, 0x00]]
    assert aqt.scale.tolist() == [[torch.tensor(2 / 448, dtype=torch.float32).item()]]


def test_e5m2_bytes_pinned():
    aqt = _f8(torch.tensor([[1.0, -0.5]]), Q.float8_e5m2, qk.PerTensor())  # codes 57344, -28672
    # e5m2: sign | eeeee (bias 15) | mm. 57344 = 1.75 * 2^15, 28672 = 1.75 * 2^14
    assert aqt.qdata.view(torch.uint8).tolist() == [[0x7B, 0xF7]]


@pytest.mark.parametrize("granularity,scales", [(qk.PerRow(), 256), (qk.PerTensor(), 1),
                                                (qk.PerBlock((128, 128)), 2 * 4)])
def test_stored_bytes_match_format_arithmetic(granularity, scales):
    aqt = _f8(torch.randn(256, 512), granularity=granularity)
    assert aqt.packed_nbytes() == 256 * 512 + 4 * scales  # 8 bits per weight + fp32 scales


def test_per_block_scales_shape_and_slicing():
    aqt = _f8(torch.randn(256, 384), granularity=qk.PerBlock((128, 128)))
    assert aqt.scale.shape == (2, 3)
    part = aqt[128:256, 128:384]
    assert part.scale.shape == (1, 2) and part.qdata.untyped_storage().data_ptr() == aqt.qdata.untyped_storage().data_ptr()
    assert torch.equal(part.dequantize(), aqt.dequantize()[128:256, 128:384])
    with pytest.raises(ValueError, match="multiples of 128"):
        aqt[64:128]


def _linear_ops(aqt, x):
    with _OpLog() as log:
        F.linear(x, aqt)
    return log.ops


def test_scaled_mm_serves_per_row_and_per_tensor_with_float8_activations():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    for g in (qk.PerRow(), qk.PerTensor()):
        aqt = _f8(w, granularity=g, act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, g))
        assert aten._scaled_mm.default in _linear_ops(aqt, x)
    per_block = _f8(w, granularity=qk.PerBlock((16, 32)), act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow()))
    weight_only = _f8(w)
    reference = _f8(w, act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow()),
                    kernel_preference=qk.KernelPreference.REFERENCE)
    for aqt in (per_block, weight_only, reference):
        assert aten._scaled_mm.default not in _linear_ops(aqt, x)
    paths = [r for r in qk.kernels.status() if r["layout"] == "float8"]
    assert {r["path"].split(" ")[0] for r in paths} == {"aten._scaled_mm", "reference", "torchqkit::linear_fp8wo"}


def test_plain_and_float8_share_the_scaled_mm_linear():
    x, w = torch.randn(5, 64), torch.randn(32, 64)
    act = qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow())
    f8 = _f8(w, act_quant=act)
    plain = qk.quantize_weight(w, Q.float8_e4m3fn, qk.PerRow(), qk.PlainLayout(), scale_dtype=torch.float32,
                               act_quant=act)
    assert torch.equal(F.linear(x, f8), F.linear(x, plain))


@pytest.mark.parametrize("config,floor_db", [
    (qk.Float8WeightOnlyConfig(), 28.0),
    (qk.Float8WeightOnlyConfig(granularity=qk.PerBlock((32, 32))), 28.0),
    (qk.Float8DynamicActivationFloat8WeightConfig(granularity=qk.PerBlock((32, 32))), 24.0),
    (qk.Float8DynamicActivationFloat8WeightConfig(), 24.0),
    (qk.Float8StaticActivationFloat8WeightConfig(act_scale=0.02, granularity=qk.PerBlock((32, 32))), 20.0),
])
def test_configs_default_to_float8_layout_and_accept_per_block(config, floor_db):
    # Measured output SQNR: 30.6 (row) / 29.5 (32x32) dB weight-only, ~26 dB with float8 activations.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 32))
    x = torch.randn(8, 128)
    ref = model(x)
    report = qk.quantize_(model, config)
    assert len(report.quantized) == 2 and isinstance(model[0].weight.qlayout, qk.Float8Layout)
    with torch.no_grad():
        assert sqnr(ref, model(x)) >= floor_db
    assert qk.config_from_dict(config.to_dict()) == config


def test_unsupported_shapes_and_qdtypes_are_reported():
    model = nn.Sequential(nn.Linear(128, 100), nn.Linear(100, 128))  # 100 rows / columns: one partial block
    x = torch.randn(2, 128)
    ref = model(x)
    report = qk.quantize_(model, qk.Float8WeightOnlyConfig(granularity=qk.PerBlock((128, 128))), strict=True)
    assert len(report.quantized) == 2 and model[0].weight.qdata.shape == (128, 128)
    with torch.no_grad():
        assert sqnr(ref, model(x)) > 25
    assert "not int8" in qk.Float8Layout().supports(qk.layouts.WeightFormat.of(Q.int8, (1, 64), (8, 64), "none"))
    with pytest.raises(ValueError, match="PerBlock"):
        qk.Float8WeightOnlyConfig(granularity=qk.PerGroup(32))
