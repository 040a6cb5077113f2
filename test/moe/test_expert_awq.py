"""AWQ of expert Parameters (Note [AWQ of expert Parameters], torchqkit/api/awq_experts.py) on tiny random Qwen3-MoE,
Mixtral and OLMoE models: scales shared by the experts for gate_up_proj (folded into the norm and the router),
per expert for down_proj (folded into its up rows), clipping per expert on its routed tokens.

Error measure (as test_expert_gptq.py): the mean squared error of the first decoder layer's MoE block output against
the float model's, int4 with groups of 32, over the calibration batches and over 4 held-out batches. Measured AWQ /
RTN ratios: calibration 0.78 (qwen3_moe), 0.81 (mixtral), 0.79 (olmoe); held-out 0.87, 0.88, 0.87; without
clipping 0.94 on calibration data. Asserted: calibration < 0.9, held-out < 0.95.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchqkit as qk
from torchqkit.algorithms.awq import awq_scales
from torchqkit.api import awq_experts

from ..common import dequantized_copy
from .models import expert_stacks, tiny_moe
from .test_expert_gptq import BASE, BATCHES, _experts, _moe_outputs, _mse, _routed

HELD_OUT = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(100 + i)) for i in range(4)]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_awq_experts_beat_rtn(name):
    model = tiny_moe(name)
    reference, held = _moe_outputs(model, BATCHES), _moe_outputs(model, HELD_OUT)
    rtn, awq = copy.deepcopy(model), copy.deepcopy(model)
    qk.quantize_(rtn, _experts(BASE))
    report = qk.quantize_(awq, _experts(qk.AWQConfig(BASE)), calibration_data=BATCHES, strict=True)
    ratio = _mse(_moe_outputs(awq, BATCHES), reference) / _mse(_moe_outputs(rtn, BATCHES), reference)
    held_ratio = _mse(_moe_outputs(awq, HELD_OUT), held) / _mse(_moe_outputs(rtn, HELD_OUT), held)
    assert ratio < 0.9 and held_ratio < 0.95, (name, ratio, held_ratio)
    gate_up = report["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.status == "quantized" and gate_up.config == "awq +clip (int4 weight-only g32)"
    assert ("shared by the" in gate_up.reason and "folded into model.layers.1.post_attention_layernorm and the router "
            "model.layers.1.mlp.gate" in gate_up.reason and "awq per expert on its routed tokens" in gate_up.reason)
    down = report["model.layers.1.mlp.experts.down_proj"].reason
    assert "scales per expert" in down and "folded into each expert's gate_up_proj up rows" in down
    # the same format as round-to-nearest: only the codes differ
    for fqn, stack in expert_stacks(awq).items():
        other = dict(rtn.named_parameters())[fqn]
        assert stack.attributes() == other.attributes() and stack.logical_shape == other.logical_shape


def test_folds_keep_the_model_consistent_and_the_router_float():
    """The norm and router folds are applied with the stacks: the quantized model computes exactly the float model
    built from its dequantized weights (float32 summation order: 2e-5 on logits ~0.5), and the router is a float
    weight scaled by the same s the norm was divided by."""
    model = tiny_moe("qwen3_moe")
    norm_before = model.model.layers[0].post_attention_layernorm.weight.detach().clone()
    router_before = model.model.layers[0].mlp.gate.weight.detach().clone()
    qk.quantize_(model, _experts(qk.AWQConfig(BASE)), calibration_data=BATCHES, strict=True)
    s = norm_before / model.model.layers[0].post_attention_layernorm.weight.detach()
    router = model.model.layers[0].mlp.gate.weight
    assert not isinstance(router, qk.AffineQuantizedTensor) and not torch.equal(s, torch.ones_like(s))
    torch.testing.assert_close(router.detach(), router_before * s, rtol=1e-6, atol=0)
    float_model = dequantized_copy(model)
    with torch.no_grad():
        for b in HELD_OUT[:2]:
            torch.testing.assert_close(model(b).logits, float_model(b).logits, atol=2e-5, rtol=0)


def test_expert_without_tokens_is_rounded_to_nearest_and_named(monkeypatch):
    """An expert no calibration token reaches gets no clipping and no own scales: exactly the round-to-nearest of
    its weight times the shared scales (which the norm's fold imposes on every expert)."""
    model = tiny_moe("qwen3_moe")
    few = [torch.tensor([[5, 17, 99]])]
    missing = sorted(set(range(8)) - _routed(model, few))
    assert len(missing) >= 2
    weight = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    shared = []

    def spy(x, *args, **kwargs):  # the first search of the first block: gate_up_proj's shared scales
        result = awq_scales(x, *args, **kwargs)
        shared.append(result[0])
        return result

    monkeypatch.setattr(awq_experts, "awq_scales", spy)
    report = qk.quantize_(model, _experts(qk.AWQConfig(BASE)), calibration_data=few, strict=True)
    fqn = "model.layers.0.mlp.experts.gate_up_proj"
    assert (f"experts {', '.join(map(str, missing))} of 8 of {fqn} got no calibration tokens: round-to-nearest"
            in report[fqn].reason)
    s = shared[0]
    stack = dict(model.named_parameters())[fqn]
    handler = qk.api.configs.base.handler_for(BASE)
    for e in missing:
        want = handler(BASE, (weight.float() * s)[e], "w")
        assert torch.equal(stack[e].dequantize(), want.dequantize()), e


def test_down_proj_alone_is_refused_with_the_reason():
    model = tiny_moe("qwen3_moe")
    configs = qk.ModuleConfigs({"re:.*experts.down_proj": qk.AWQConfig(BASE), "re:.*experts.gate_up_proj": BASE,
                                "_default": None})
    with pytest.warns(UserWarning, match="selected layer"):
        report = qk.quantize_(model, configs, calibration_data=BATCHES[:1])
    entry = report["model.layers.0.mlp.experts.down_proj"]
    assert entry.status == "skipped" and "give gate_up_proj the same AWQConfig" in entry.reason
    assert report["model.layers.0.mlp.experts.gate_up_proj"].status == "quantized"


def test_structure_awq_does_not_know_is_skipped_with_the_reason():
    model = tiny_moe("gpt_oss")
    with pytest.warns(UserWarning, match="4 selected layer"):
        report = qk.quantize_(model, _experts(qk.AWQConfig(BASE)), calibration_data=BATCHES[:1])
    entry = report["model.layers.0.mlp.experts.gate_up_proj"]
    assert entry.status == "skipped" and "AWQ of expert Parameters knows experts computing" in entry.reason
    assert not expert_stacks(model)
