"""GPTQ for configs that quantize activations at run time, W4A8 first (int8 dynamic activations x int4 weights): the
codes come from GPTQ on the config's own weight grid, the layer keeps the config's format and kernel route, and the
result beats round-to-nearest on held-out tokens. See Note [GPTQ Hessians under dynamic activations]."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import torchqkit as qk
from torchqkit.layouts.routes import route_for

from ..common import OpLog
from ..eval.models import tiny_llama_with_outlier_norms

W4A8 = qk.Int8DynamicActivationIntxWeightConfig(weight_bits=4, weight_granularity=qk.PerGroup(16))
CALIBRATION = 8  # sequences of 48 tokens; 4 more from the same distribution are held out


@pytest.fixture(scope="module")
def llama():
    return tiny_llama_with_outlier_norms(vocab_size=96)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (CALIBRATION + 4, 48), generator=torch.Generator().manual_seed(0))


def _quantize(model, config, **kwargs):
    q = copy.deepcopy(model)
    report = qk.quantize_(q, qk.ModuleConfigs({"lm_head": None, "_default": config}), **kwargs)
    return q, report


def _gptq(model, base, ids):
    q, report = _quantize(model, qk.GPTQConfig(base), calibration_data=[ids[i:i + 1] for i in range(CALIBRATION)])
    assert len(report.quantized) == 14 and not report.skipped
    return q, report


@torch.no_grad()
def _held_out_err(model, q, ids):
    """Relative logits error (mean square) on the held-out sequences."""
    ref, out = model(ids[CALIBRATION:]).logits, q(ids[CALIBRATION:]).logits
    return float((out - ref).square().mean() / ref.square().mean())


@pytest.fixture(scope="module")
def w4a8(llama, ids):
    return _gptq(llama, W4A8, ids)


def test_gptq_w4a8_beats_round_to_nearest_on_held_out_tokens(llama, ids, w4a8):
    rtn, _ = _quantize(llama, W4A8)
    q, report = w4a8
    # measured 0.63 (0.71 and 0.81 with model / data seeds 1 and 2); 0.75 leaves room for other CPUs' rounding
    assert _held_out_err(llama, q, ids) < 0.75 * _held_out_err(llama, rtn, ids)
    assert report["model.layers.0.mlp.down_proj"].config.startswith("gptq (int8 dynamic act x int4 weight g16")


def test_gptq_w4a8_layers_keep_the_format_and_take_the_int8_x_int4_kernel(llama, ids, w4a8):
    q, _ = w4a8
    rtn, _ = _quantize(llama, W4A8)
    linears = [(n, m) for n, m in q.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, m in linears:
        w, theirs = m.weight, rtn.model.layers.get_submodule(name).weight
        assert isinstance(w.qlayout, qk.PackedIntxLayout) and w.qdtype == qk.qdtypes.int4
        assert (w.block_size, w.act_quant, w.kernel_preference) == \
            (theirs.block_size, theirs.act_quant, theirs.kernel_preference)
        assert w.act_quant.qdtype == qk.qdtypes.int8
        assert route_for(w, torch.randn(3, w.shape[1])).op == "torchqkit::linear_int8da_int4_packed"
        assert not torch.equal(w.dequantize(), theirs.dequantize())  # GPTQ chose other codes than rounding
    with OpLog() as log, torch.no_grad():
        q(ids[CALIBRATION:])
    assert log.ops.count("linear_int8da_int4_packed") == len(linears) == 14
    rows = [r for r in qk.kernels.status() if r["layout"] == "packed_intx"
            and r["path"].startswith("torchqkit::linear_int8da_int4_packed")]
    assert len(rows) == 1 and rows[0]["linear"].startswith("int8 or int4 dynamic act")


@torch.no_grad()
def test_gptq_w4a8_checkpoints_round_trip(llama, ids, w4a8, tmp_path):
    q, _ = w4a8
    expected = q(ids[CALIBRATION:]).logits
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    fresh = copy.deepcopy(llama)
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    assert torch.equal(fresh(ids[CALIBRATION:]).logits, expected)
    qk.save_quantized(q, tmp_path / "w4a8.safetensors")
    loaded = qk.load_quantized(copy.deepcopy(llama), tmp_path / "w4a8.safetensors")
    assert isinstance(loaded.model.layers[1].mlp.down_proj.weight.qlayout, qk.PackedIntxLayout)
    assert torch.equal(loaded(ids[CALIBRATION:]).logits, expected)


@pytest.mark.parametrize("base, most", [
    # measured 0.70: asymmetric int4 with integer zero points
    (qk.Int8DynamicActivationIntxWeightConfig(weight_granularity=qk.PerGroup(16), weight_mapping="asymmetric"), 0.85),
    # measured 0.58: GGUF Q4_1 weights (float16 scale and float minimum) x Q8_1-style activations per group
    (qk.Int8DynamicActivationIntxWeightConfig(weight_granularity=qk.PerGroup(16), weight_mapping="asymmetric",
                                              weight_zero_point_domain="float", weight_scale_dtype="float16",
                                              act_granularity=qk.PerGroup(16), act_mapping="symmetric"), 0.75),
    # measured 0.75: 3 bits, one scale per output channel, PlainLayout
    (qk.Int8DynamicActivationIntxWeightConfig(weight_bits=3, weight_granularity=qk.PerAxis(0)), 0.9),
    # measured 0.62
    (qk.Float8DynamicActivationInt4WeightConfig(group_size=16), 0.75),
    # measured 0.98: int4 activations' rounding dominates the error on this model, and GPTQ doesn't touch it
    (qk.Int4DynamicActivationInt4WeightConfig(group_size=16), 1.05),
])
def test_other_dynamic_activation_grids(llama, ids, base, most):
    q, _ = _gptq(llama, base, ids)
    rtn, _ = _quantize(llama, base)
    mine, theirs = q.model.layers[1].mlp.down_proj.weight, rtn.model.layers[1].mlp.down_proj.weight
    assert (type(mine.qlayout), mine.qdtype, mine.block_size, mine.act_quant, mine.zero_point_domain) == \
        (type(theirs.qlayout), theirs.qdtype, theirs.block_size, theirs.act_quant, theirs.zero_point_domain)
    assert _held_out_err(llama, q, ids) < most * _held_out_err(llama, rtn, ids)


def test_a_base_gptq_cannot_serve_is_refused_by_name():
    with pytest.raises(TypeError, match=r"GPTQConfig: base must be one of \[.*'Int8DynamicActivationIntxWeightConfig'"
                                        r".*got Float8DynamicActivationFloat8WeightConfig"):
        qk.GPTQConfig(qk.Float8DynamicActivationFloat8WeightConfig())
    data = qk.GPTQConfig(W4A8).to_dict()
    data["base"] = qk.MXDynamicActivationMXWeightConfig(weight="mxfp4").to_dict()
    with pytest.raises(TypeError, match="GPTQConfig: base must be one of.*got MXDynamicActivationMXWeightConfig"):
        qk.config_from_dict(data)


def test_a_weight_the_base_cannot_take_is_named_and_the_model_left_alone(llama, ids):
    bad = qk.GPTQConfig(qk.Int8DynamicActivationIntxWeightConfig(weight_bits=8, layout=qk.PackedIntxLayout()))
    q = copy.deepcopy(llama)
    with pytest.raises(qk.QuantizationError, match=r"left unchanged because model\.layers\.0\.self_attn\.q_proj: "
                                                   r"model\.layers\.0\.self_attn\.q_proj\.weight: PackedIntxLayout "
                                                   r"packs 1\.\.7-bit codes.*use PlainLayout"):
        qk.quantize_(q, qk.ModuleConfigs({"lm_head": None, "_default": bad}), calibration_data=[ids[:1]],
                     strict=True)
    assert all(type(p) is torch.nn.Parameter and torch.equal(p, r) for p, r in zip(q.parameters(), llama.parameters()))
