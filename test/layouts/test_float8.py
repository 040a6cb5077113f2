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


def test_float8_activations_on_cpu_take_the_weight_only_kernel_and_scaled_mm_stays_for_gpus():
    """On a CPU, float8 x float8 (per row, per tensor, per block) runs the activation's C++ fake quantization and
    linear_fp8wo, equal to the reference up to float32 summation order; torch._scaled_mm is the route elsewhere
    (per row / per tensor), checked here on CPU tensors through its aten call (torch's CPU reference of it)."""
    from torchqkit.layouts.scaled_mm import scaled_mm_linear
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    per_block = _f8(w, granularity=qk.PerBlock((16, 32)),
                    act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow()))
    for g in (qk.PerRow(), qk.PerTensor()):
        aqt = _f8(w, granularity=g, act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, g))
        for q in (aqt, per_block):
            ops = _linear_ops(q, x)
            assert torch.ops.torchqkit.linear_fp8wo.default in ops and aten._scaled_mm.default not in ops
            assert torch.ops.torchqkit.fake_quantize_activation.default in ops
            ref = qk.layouts.routes.reference_linear(q, x, None)
            assert (F.linear(x, q) - ref).abs().max() <= 2e-6 * ref.abs().max()
        ref = qk.layouts.routes.reference_linear(aqt, x, None)
        assert (scaled_mm_linear(aqt, x, None) - ref).abs().max() <= 2e-6 * ref.abs().max()
    reference = _f8(w, act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow()),
                    kernel_preference=qk.KernelPreference.REFERENCE)
    assert torch.ops.torchqkit.linear_fp8wo.default not in _linear_ops(reference, x)
    paths = [r for r in qk.kernels.status() if r["layout"] == "float8"]
    assert {r["path"].split(" ")[0] for r in paths} == {"aten._scaled_mm", "reference", "torchqkit::linear_fp8wo",
                                                        "torchqkit::scaled_mm_fp8_rowwise"}  # fnuz on NVIDIA


def test_plain_and_float8_share_the_float8_linear():
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


# ------------------------------------------------------------------------------------------------
# AMD's fnuz formats (Note [float8 fnuz] in core/qdtype.py)
# ------------------------------------------------------------------------------------------------

FNUZ = [pytest.param(Q.float8_e4m3fnuz, id="e4m3fnuz"), pytest.param(Q.float8_e5m2fnuz, id="e5m2fnuz")]


def test_fnuz_bytes_pinned():
    aqt = _f8(torch.tensor([[2.0, -1.0, 0.5, 0.0]]), Q.float8_e4m3fnuz)  # scale 2 / 240: codes 240, -120, 60, 0
    # e4m3fnuz: sign | eeee (bias 8) | mmm. 240 = 1.875 * 2^7 (0x7F: NaN in e4m3fn), 120 = 1.875 * 2^6, 60 = 1.875 * 2^5
    assert aqt.qdata.dtype == torch.float8_e4m3fnuz
    assert aqt.qdata.view(torch.uint8).tolist() == [[0x7F, 0xF7, 0x6F, 0x00]]
    assert aqt.scale.tolist() == [[torch.tensor(2 / 240, dtype=torch.float32).item()]]
    aqt = _f8(torch.tensor([[1.0, -0.5]]), Q.float8_e5m2fnuz, qk.PerTensor())  # codes 57344, -28672
    # e5m2fnuz: sign | eeeee (bias 16) | mm. 57344 = 1.75 * 2^15 (exponent 31: finite here), 28672 = 1.75 * 2^14
    assert aqt.qdata.view(torch.uint8).tolist() == [[0x7F, 0xFB]]


@pytest.mark.parametrize("qdtype", FNUZ)
def test_fnuz_every_byte_dequantizes_exactly(qdtype):
    aqt = _f8(torch.randn(16, 16), qdtype, qk.PerTensor())
    aqt.qdata.view(torch.uint8).copy_(torch.arange(256, dtype=torch.uint8).reshape(16, 16))
    got, want = aqt.dequantize(), aqt.qdata.to(torch.float32) * aqt.scale  # torch's own float8 conversion
    assert torch.isnan(got).reshape(-1).nonzero().reshape(-1).tolist() == [0x80]
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("qdtype", FNUZ)
def test_fnuz_linear_runs_the_kernel_and_scaled_mm(qdtype):
    x, w = torch.randn(5, 64), torch.randn(32, 64) * 0.05
    weight_only = _f8(w, qdtype)
    assert torch.ops.torchqkit.linear_fp8wo.default in _linear_ops(weight_only, x)
    ref = F.linear(x, weight_only.dequantize())
    # the kernel and the reference decode the same bytes; float32 summation order apart
    assert (F.linear(x, weight_only) - ref).abs().max() <= 2e-5 * ref.abs().max()
    from torchqkit.layouts.scaled_mm import scaled_mm_linear
    for g in (qk.PerRow(), qk.PerTensor()):
        dynamic = _f8(w, qdtype, g, act_quant=qk.ActivationQuantSpec(qdtype, g))
        assert torch.ops.torchqkit.linear_fp8wo.default in _linear_ops(dynamic, x)  # on a CPU: the kernel
        reference = qk.layouts.routes.reference_linear(dynamic, x, None)
        assert (F.linear(x, dynamic) - reference).abs().max() <= 2e-5 * reference.abs().max()
        # torch._scaled_mm takes fnuz operands (its CPU reference here; ROCm's on MI300). Note [torch._scaled_mm's
        # contract]: the same products, summed in torch's CPU kernel's order (bit for bit on Intel AVX-512; a few
        # float32 ulps apart on AMD Zen 5)
        assert (scaled_mm_linear(dynamic, x, None) - reference).abs().max() <= 2e-6 * reference.abs().max()


def test_fnuz_on_an_nvidia_gpu_takes_the_rowwise_op(monkeypatch):
    """cuBLASLt (torch._scaled_mm on NVIDIA) has no fnuz: that case routes to torchqkit::scaled_mm_fp8_rowwise, which
    decodes the bytes; ROCm keeps torch._scaled_mm, a CPU the weight-only kernel. The route's call runs here on CPU tensors (the op's
    reference), and must equal the reference linear."""
    import types
    from torchqkit.layouts.routes import route_for
    from torchqkit.layouts.scaled_mm import FLOAT8_ON_CPU_ROUTE, FNUZ_ON_NVIDIA_ROUTE, SCALED_MM_ROUTE
    w, x = torch.randn(32, 64) * 0.05, torch.randn(5, 64)
    fnuz = _f8(w, Q.float8_e4m3fnuz, act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fnuz, qk.PerRow()))
    ocp = _f8(w, Q.float8_e4m3fn, act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow()))
    on_gpu = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda"))
    monkeypatch.setattr(torch.version, "hip", None)
    assert route_for(fnuz, on_gpu) is FNUZ_ON_NVIDIA_ROUTE
    assert route_for(ocp, on_gpu) is SCALED_MM_ROUTE and route_for(fnuz, x) is FLOAT8_ON_CPU_ROUTE
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert route_for(fnuz, on_gpu) is SCALED_MM_ROUTE  # ROCm's _scaled_mm takes fnuz
    out = FNUZ_ON_NVIDIA_ROUTE.call(torch.ops.torchqkit.scaled_mm_fp8_rowwise, fnuz, x, None)
    ref = qk.layouts.routes.reference_linear(fnuz, x, None)
    assert (out - ref).abs().max() <= 1e-6 * ref.abs().max()
    rows = [r for r in qk.kernels.status() if r["layout"] == "float8" and "NVIDIA" in r["linear"]]
    assert len(rows) == 1 and rows[0]["path"].startswith("torchqkit::scaled_mm_fp8_rowwise")


@pytest.mark.parametrize("qdtype", FNUZ)
def test_fnuz_checkpoints_round_trip(qdtype, tmp_path):
    import io

    import safetensors.torch

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))

    quantized = model()
    qk.quantize_(quantized, qk.Float8WeightOnlyConfig(weight_dtype=qdtype), filter_fn=lambda m, f: f == "0")
    qk.quantize_(quantized, qk.Float8DynamicActivationFloat8WeightConfig(activation_dtype=qdtype, weight_dtype=qdtype),
                 filter_fn=lambda m, f: f == "1")
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = quantized(x)
    path = tmp_path / "m.safetensors"
    qk.save_quantized(quantized, path)
    # safetensors' own reader sees the fnuz dtype (F8_E4M3FNUZ / F8_E5M2FNUZ in the header)
    raw = safetensors.torch.load_file(path)
    assert {t.dtype for t in raw.values() if t.element_size() == 1} == {qdtype.storage_dtype}
    loaded = qk.load_quantized(model(), path)
    buf = io.BytesIO()
    torch.save(quantized.state_dict(), buf)
    buf.seek(0)
    pickled = model()
    pickled.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    for m in (loaded, pickled):
        for i in (0, 1):
            got, src = m[i].weight, quantized[i].weight
            assert got.qdtype is qdtype and got.qdata.dtype == qdtype.storage_dtype
            assert torch.equal(got.qdata.view(torch.uint8), src.qdata.view(torch.uint8))
            assert torch.equal(got.scale, src.scale)
        assert m[1].weight.act_quant == quantized[1].weight.act_quant
        with torch.no_grad():
            assert torch.equal(m(x), want)


def test_fnuz_combinations_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="mixes an OCP float8 .* with an AMD fnuz one"):
        qk.Float8DynamicActivationFloat8WeightConfig(activation_dtype="float8_e4m3fn", weight_dtype="float8_e4m3fnuz")
    with pytest.raises(ValueError, match="mixes an OCP float8"):
        qk.Float8StaticActivationFloat8WeightConfig(act_scale=0.1, activation_dtype="float8_e5m2fnuz")
    with pytest.raises(ValueError, match=r"MX spec's elements are OCP float8; for AMD's fnuz formats use "
                                         r"Float8WeightOnlyConfig\(weight_dtype='float8_e4m3fnuz'"):
        qk.MXFP8WeightOnlyConfig(element_dtype="float8_e4m3fnuz")
    with pytest.raises(ValueError, match="MXFP8, whose elements are OCP float8_e4m3fn / float8_e5m2, not "
                                         "float8_e5m2fnuz"):
        qk.ActivationQuantSpec(Q.float8_e5m2fnuz, qk.PerGroup(32))
    with pytest.raises(ValueError, match="must be float8_e4m3fn, float8_e5m2, float8_e4m3fnuz or float8_e5m2fnuz, "
                                         "got int8"):
        qk.Float8WeightOnlyConfig(weight_dtype="int8")
    # both fnuz: accepted, and the config round-trips through JSON
    config = qk.Float8DynamicActivationFloat8WeightConfig(activation_dtype="float8_e4m3fnuz",
                                                          weight_dtype="float8_e5m2fnuz")
    assert qk.config_from_dict(config.to_dict()) == config
