"""SmoothQuant and static activation scales of expert Parameters (Note [SmoothQuant and static activation scales of
expert Parameters], torchqkit/api/smoothquant_experts.py) on tiny random Qwen3-MoE, Mixtral and OLMoE models.

Error measure (as test_expert_gptq.py): the mean squared error of the first decoder layer's MoE block output against
the float model's, over the calibration batches. With an outlier feature in the experts' input (one channel of the
norm weight x 40, as LLM activations have), int8 x int8 per token, alpha 0.5: SmoothQuant / plain measured 0.14
(qwen3_moe), 0.51 (mixtral), 0.61 (olmoe); asserted < 0.75.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchqkit as qk

from ..common import dequantized_copy
from .models import expert_stacks, tiny_moe
from .test_expert_gptq import BATCHES, _experts, _moe_outputs, _mse, _routed

DYNAMIC = qk.Int8DynamicActivationInt8WeightConfig()
OUTLIER = 7  # the hidden feature made an outlier


def _with_outlier(name: str):
    """The model with one feature of every post-attention norm x 40: the experts' input gets an outlier channel."""
    model = tiny_moe(name)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[OUTLIER] *= 40
    return model


def _expert_inputs(model, batches) -> torch.Tensor:
    """Every hidden row the first layer's experts module receives over ``batches``."""
    rows = []
    handle = model.model.layers[0].mlp.experts.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone()),
        with_kwargs=True)
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        handle.remove()
    return torch.cat(rows)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_smoothquant_experts_beat_plain_int8_on_an_outlier_feature(name):
    model = _with_outlier(name)
    reference = _moe_outputs(model, BATCHES)
    plain, smooth = copy.deepcopy(model), copy.deepcopy(model)
    qk.quantize_(plain, _experts(DYNAMIC))
    report = qk.quantize_(smooth, _experts(qk.SmoothQuantConfig(DYNAMIC, alpha=0.5)), calibration_data=BATCHES,
                          strict=True)
    ratio = _mse(_moe_outputs(smooth, BATCHES), reference) / _mse(_moe_outputs(plain, BATCHES), reference)
    assert ratio < 0.75, (name, ratio)
    gate_up = report["model.layers.1.mlp.experts.gate_up_proj"].reason
    assert ("smoothquant alpha 0.5: scales shared by the" in gate_up and "folded into "
            "model.layers.1.post_attention_layernorm and the router model.layers.1.mlp.gate" in gate_up)
    down = report["model.layers.1.mlp.experts.down_proj"].reason
    assert "scales per expert folded into each expert's gate_up_proj up rows" in down
    for fqn, stack in expert_stacks(smooth).items():  # the base config's format: only the values differ
        other = dict(plain.named_parameters())[fqn]
        assert stack.attributes() == other.attributes() and stack.act_quant == other.act_quant


def test_folds_keep_the_function_and_the_router_float():
    """Norm, router and up-row folds are installed with the stacks: the model rebuilt in float from the dequantized
    weights (int8 per channel) computes the original model's logits up to weight rounding (measured 6.8e-3 and 8.5e-3
    of the largest logit; the norm's fold left out: 1.36), and the router is a float weight scaled by the same s the
    norm was divided by."""
    model = _with_outlier("qwen3_moe")
    original = copy.deepcopy(model)
    norm_before = model.model.layers[0].post_attention_layernorm.weight.detach().clone()
    router_before = model.model.layers[0].mlp.gate.weight.detach().clone()
    qk.quantize_(model, _experts(qk.SmoothQuantConfig(DYNAMIC)), calibration_data=BATCHES, strict=True)
    s = norm_before / model.model.layers[0].post_attention_layernorm.weight.detach()
    assert float(s[OUTLIER]) > 3 * float(s.median())  # the outlier feature moved most into the weights
    router = model.model.layers[0].mlp.gate.weight
    assert not isinstance(router, qk.AffineQuantizedTensor)
    torch.testing.assert_close(router.detach(), router_before * s, rtol=1e-6, atol=0)
    float_model = dequantized_copy(model)
    with torch.no_grad():
        for b in BATCHES[:2]:
            out, ref = float_model(b).logits, original(b).logits
            assert float((out - ref).abs().max()) < 3e-2 * float(ref.abs().max())


@pytest.mark.parametrize("config", [qk.Int8StaticActivationInt8WeightConfig(),
                                    qk.Int8StaticActivationInt8WeightConfig(smoothing=None),
                                    qk.Float8StaticActivationFloat8WeightConfig()],
                         ids=["int8-smoothed", "int8", "float8"])
def test_static_scale_covers_every_routed_row_of_the_stack(config):
    """minmax: the gate_up_proj stack's static scale is the largest |x| any expert received (every row reaches its
    top-k experts, so the experts' largest range is the whole input's), divided by the format's largest code; the
    quantized model, fed the calibration batches again, gives its experts the very rows calibration observed."""
    model = tiny_moe("qwen3_moe")
    report = qk.quantize_(model, _experts(config), calibration_data=BATCHES, strict=True)
    stack = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    rows = _expert_inputs(model, BATCHES)
    qmax = float(stack.act_quant.qdtype.qmax)
    assert stack.act_quant.static_scale == pytest.approx(float(rows.abs().max()) / qmax, rel=1e-6)
    down = dict(model.named_parameters())["model.layers.0.mlp.experts.down_proj"]
    assert down.act_quant.static_scale is not None and down.act_quant.static_scale > 0
    reason = report["model.layers.0.mlp.experts.gate_up_proj"].reason
    assert "the largest of the experts' ranges" in reason and "static activation scale" in reason
    assert ("smoothquant alpha 0.8" in reason) == (getattr(config, "smoothing", None) is not None)
    with torch.no_grad():
        for impl in ("eager", "grouped_mm", "batched_mm"):  # every implementation gives the same logits
            model.set_experts_implementation(impl)
            out = model(BATCHES[0]).logits
            if impl == "eager":
                first = out
            torch.testing.assert_close(out, first, atol=1e-5 * float(first.abs().max()), rtol=0)


def test_expert_without_tokens_is_named_and_covered_by_the_stack_scale():
    model = tiny_moe("qwen3_moe")
    few = [torch.tensor([[5, 17, 99]])]
    missing = sorted(set(range(8)) - _routed(model, few))
    assert len(missing) >= 2
    report = qk.quantize_(model, _experts(qk.Int8StaticActivationInt8WeightConfig()), calibration_data=few,
                          strict=True)
    fqn = "model.layers.0.mlp.experts.down_proj"
    assert (f"experts {', '.join(map(str, missing))} of 8 of {fqn} got no calibration tokens: no smoothing of their "
            f"own, under the stack's static scale" in report[fqn].reason)
    stack = dict(model.named_parameters())[fqn]
    assert all(stack[e].act_quant == stack[0].act_quant for e in missing)


def test_down_proj_smoothing_alone_is_refused_with_the_reason():
    model = tiny_moe("qwen3_moe")
    configs = qk.ModuleConfigs({"re:.*experts.down_proj": qk.SmoothQuantConfig(DYNAMIC), "re:.*experts.gate_up_proj":
                                DYNAMIC, "_default": None})
    with pytest.warns(UserWarning, match="selected layer"):
        report = qk.quantize_(model, configs, calibration_data=BATCHES[:1])
    entry = report["model.layers.0.mlp.experts.down_proj"]
    assert entry.status == "skipped" and "folds its scales into gate_up_proj's up rows" in entry.reason
    assert report["model.layers.0.mlp.experts.gate_up_proj"].status == "quantized"


def test_structure_smoothquant_does_not_know_is_skipped_with_the_reason():
    model = tiny_moe("gpt_oss")
    with pytest.warns(UserWarning, match="4 selected layer"):
        report = qk.quantize_(model, _experts(qk.SmoothQuantConfig(DYNAMIC)), calibration_data=BATCHES[:1])
    entry = report["model.layers.0.mlp.experts.gate_up_proj"]
    assert entry.status == "skipped" and "SmoothQuant of expert Parameters knows experts computing" in entry.reason
    assert not expert_stacks(model)


def test_static_config_without_data_is_refused_before_anything_changes():
    model = tiny_moe("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="need\\(s\\) calibration data"):
        qk.quantize_(model, _experts(qk.Int8StaticActivationInt8WeightConfig()))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
