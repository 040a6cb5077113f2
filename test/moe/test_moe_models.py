"""Tiny random Qwen3-MoE, Mixtral and OLMoE quantized by quantize_: every expert Parameter quantized and reported,
routers kept float, and the logits of each transformers experts implementation equal to the float model built
from the dequantized weights.

Tolerances: weight-only configs run each expert's layout kernel on float32 inputs, so the logits (magnitude ~0.5)
differ from the dequantized float model's by float32 rounding of reordered sums: 2e-5 absolute. Activation-
quantizing configs: the three experts implementations agree within 1e-5 (the same kernels on the same rows);
against the same weights on the reference path (dequantize, fake-quantize the activation, F.linear) SQNR >= 40 dB,
not equality, because an activation code computed by the fused int8 kernel can land on the other side of a rounding
boundary than the reference's and the difference grows over two layers (measured 45-47 dB for int8 x int8, > 130 dB
for the others); against the dequantized float model (activations not quantized) SQNR >= 25 dB (measured 27-41)."""
from __future__ import annotations

import copy

import pytest
import torch

import torchqkit as qk

from ..common import dequantized_copy, sqnr
from .models import IMPLEMENTATIONS, MODELS, expert_stacks, tiny_moe

WEIGHT_ONLY = {
    "int4": qk.Int4WeightOnlyConfig(group_size=32),
    "int4_hqq": qk.Int4WeightOnlyConfig(group_size=32, algorithm="hqq"),
    "int8": qk.Int8WeightOnlyConfig(),
    "nf4": qk.NF4WeightOnlyConfig(),
    "int3": qk.IntxWeightOnlyConfig(bits=3),
    "float8": qk.Float8WeightOnlyConfig(),
    "mxfp4": qk.MXFP4WeightOnlyConfig(),
}
DYNAMIC = {
    "int8_dyn": qk.Int8DynamicActivationInt8WeightConfig(),
    "int8_dyn_int4": qk.Int8DynamicActivationIntxWeightConfig(),
    "float8_dyn": qk.Float8DynamicActivationFloat8WeightConfig(),
}
IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))


def _logits(model, impl):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(IDS).logits


def _on_reference_path(model):
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if isinstance(p, qk.AffineQuantizedTensor):
                setattr(module, attr, torch.nn.Parameter(p.with_changes(kernel_preference="reference"),
                                                         requires_grad=False))
    return model


@pytest.mark.parametrize("config", WEIGHT_ONLY)
@pytest.mark.parametrize("name", MODELS)
def test_weight_only_logits_equal_the_dequantized_model(name, config):
    model = tiny_moe(name)
    report = qk.quantize_(model, WEIGHT_ONLY[config], strict=True)
    stacks = expert_stacks(model)
    assert len(stacks) == 4 and all(s.dim() == 3 for s in stacks.values())
    assert all(report[f].status == "quantized" for f in stacks)
    float_model = dequantized_copy(model)
    for impl in IMPLEMENTATIONS:
        torch.testing.assert_close(_logits(model, impl), _logits(float_model, impl), atol=2e-5, rtol=0)


@pytest.mark.parametrize("config", DYNAMIC)
@pytest.mark.parametrize("name", MODELS)
def test_dynamic_activation_logits(name, config):
    model = tiny_moe(name)
    qk.quantize_(model, DYNAMIC[config], strict=True)
    reference, float_model = _on_reference_path(dequantized_copy_keep(model)), dequantized_copy(model)
    eager = _logits(model, "eager")
    for impl in IMPLEMENTATIONS:
        out = _logits(model, impl)
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)
        assert sqnr(_logits(reference, impl), out) >= 40.0
        assert sqnr(_logits(float_model, impl), out) >= 25.0


def dequantized_copy_keep(model):
    """A deep copy still holding the quantized weights (the reference path is switched on it)."""
    return copy.deepcopy(model)


def test_report_lists_every_expert_tensor_and_keeps_routers():
    model = tiny_moe("qwen3_moe")
    float_logits = _logits(model, "grouped_mm")
    report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
    names = [e.fqn for e in report.entries]
    for layer in (0, 1):
        for attr in ("gate_up_proj", "down_proj"):
            entry = report[f"model.layers.{layer}.mlp.experts.{attr}"]
            e, n, k = 8, (64 if attr == "gate_up_proj" else 64), (64 if attr == "gate_up_proj" else 32)
            assert entry.status == "quantized" and entry.bytes_before == e * n * k * 4
            assert entry.bytes_after == expert_stacks(model)[entry.fqn].packed_nbytes()
            assert f"8 experts of ({n}, {k}), {entry.bytes_after // 8:,} bytes each" in entry.reason
        router = report[f"model.layers.{layer}.mlp.gate"]
        assert router.status == "kept" and "router of" in router.reason and router.bytes_after == 8 * 64 * 4
        assert not isinstance(model.model.layers[layer].mlp.gate.weight, qk.AffineQuantizedTensor)
    assert names.index("model.layers.0.mlp.experts.gate_up_proj") < names.index("model.layers.1.self_attn.q_proj")
    assert sqnr(float_logits, _logits(model, "grouped_mm")) >= 15.0


def test_module_configs_name_expert_tensors():
    model = tiny_moe("olmoe")
    configs = qk.ModuleConfigs({"model.layers.0.mlp.experts.down_proj": None,
                                "re:.*experts.*": qk.Int8WeightOnlyConfig(), "_default": None})
    report = qk.quantize_(model, configs, strict=True)
    assert report["model.layers.0.mlp.experts.down_proj"].status == "kept"
    assert report["model.layers.1.mlp.experts.down_proj"].status == "quantized"
    assert report["model.layers.0.mlp.experts.gate_up_proj"].config == "int8 weight-only per-channel"
    assert report["model.layers.0.self_attn.q_proj"].status == "kept"
    assert set(expert_stacks(model)) == {"model.layers.0.mlp.experts.gate_up_proj",
                                         "model.layers.1.mlp.experts.gate_up_proj",
                                         "model.layers.1.mlp.experts.down_proj"}


def test_a_linear_router_is_kept_unless_named():
    model = tiny_moe("mixtral")
    for layer in model.model.layers:  # an nn.Linear router, as older MoE code has
        linear = torch.nn.Linear(64, 4, bias=False)
        linear.weight.data.copy_(layer.mlp.gate.weight.data)
        layer.mlp.gate.weight = linear.weight
        layer.mlp.gate_linear = linear
    model.model.layers[0].mlp.gate = _LinearRouter(model.model.layers[0].mlp.gate_linear, 2)
    del model.model.layers[0].mlp.gate_linear
    report = qk.quantize_(model, qk.ModuleConfigs({"_default": qk.Int8WeightOnlyConfig()}))
    assert report["model.layers.0.mlp.gate"].status == "kept"
    assert not isinstance(model.model.layers[0].mlp.gate.weight, qk.AffineQuantizedTensor)
    model = tiny_moe("mixtral")
    model.model.layers[0].mlp.gate = _LinearRouter(torch.nn.Linear(64, 4, bias=False), 2)
    report = qk.quantize_(model, qk.ModuleConfigs({"model.layers.0.mlp.gate": qk.Int8WeightOnlyConfig(),
                                                   "_default": qk.Int8WeightOnlyConfig()}))
    assert report["model.layers.0.mlp.gate"].status == "quantized"


class _LinearRouter(torch.nn.Linear):
    """An nn.Linear router returning what transformers' TopKRouter returns."""
    def __init__(self, linear, top_k):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight = linear.weight
        self.top_k = top_k

    def forward(self, x):
        logits = super().forward(x.reshape(-1, self.in_features))
        scores, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, scores / scores.sum(-1, keepdim=True), index


def test_missing_router_is_reported_and_strict_changes_nothing():
    model = tiny_moe("olmoe")
    for layer in model.model.layers:
        layer.mlp.route = layer.mlp.gate  # renamed: quantize_ can't find it
        del layer.mlp.gate
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(qk.QuantizationError, match=r"model.layers.0.mlp.experts: no router found next to the "
                                                   r"experts \(looked for model.layers.0.mlp.gate"):
        qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32), strict=True)
    after = dict(model.named_parameters())
    assert all(type(after[n]) is torch.nn.Parameter and torch.equal(after[n], p) for n, p in before.items())
    with pytest.warns(UserWarning, match="no router found"):
        report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
    assert report["model.layers.1.mlp.experts"].status == "skipped"


def test_expert_tensor_a_layout_cant_take_is_reported_per_parameter():
    model = tiny_moe("qwen3_moe")
    with torch.no_grad():  # expert 3's values are too large for the int4 tiled kernel's float32 sums
        model.model.layers[0].mlp.experts.down_proj[3] = torch.randn(64, 32) * 1e37
    config = qk.Int4WeightOnlyConfig(group_size=32)
    with pytest.raises(qk.QuantizationError, match=r"model.layers.0.mlp.experts.down_proj: model.layers.0.mlp."
                                                   r"experts.down_proj\[3\]: TensorCoreTiledLayout's kernels"):
        qk.quantize_(model, config, strict=True)
    assert not expert_stacks(model)
    with pytest.warns(UserWarning, match=r"experts.down_proj\[3\]"):
        report = qk.quantize_(model, config)
    assert report["model.layers.0.mlp.experts.down_proj"].status == "skipped"
    assert set(expert_stacks(model)) == {"model.layers.0.mlp.experts.gate_up_proj",
                                         "model.layers.1.mlp.experts.gate_up_proj",
                                         "model.layers.1.mlp.experts.down_proj"}


def test_generate_with_quantized_experts():
    model = tiny_moe("mixtral")
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
    float_model = dequantized_copy(model)
    for impl in IMPLEMENTATIONS:
        model.set_experts_implementation(impl)
        float_model.set_experts_implementation(impl)
        out = model.generate(IDS[:1], max_new_tokens=6, do_sample=False)
        assert out.shape == (1, 13) and torch.equal(out, float_model.generate(IDS[:1], max_new_tokens=6,
                                                                              do_sample=False))


@pytest.mark.parametrize("name", MODELS)
def test_every_implementation_runs_under_inference_mode(name):
    """Note [Views under inference mode]: the stacks' views (w[e], w.transpose, w[ids]) inside
    torch.inference_mode() on weights quantized outside it; the same logits as under no_grad."""
    model = tiny_moe(name)
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32), strict=True)
    for impl in IMPLEMENTATIONS:
        expected = _logits(model, impl)
        with torch.inference_mode():
            assert torch.equal(model(IDS).logits, expected), impl


@pytest.mark.parametrize("config", ["int4", "int8"])
def test_transposed_experts_with_biases(config):
    """gpt-oss stores its experts (E, K, N) with float biases and calls ``x @ w[e]`` in its eager path: the stacks
    are transposed views of (E, N, K) quantized experts, the biases stay float, the router ("router") stays float."""
    model = tiny_moe("gpt_oss")
    report = qk.quantize_(model, WEIGHT_ONLY[config], strict=True)
    stacks = expert_stacks(model)
    assert {n: (tuple(s.shape), s.transposed) for n, s in stacks.items() if ".0." in n} == {
        "model.layers.0.mlp.experts.gate_up_proj": ((4, 64, 64), True),
        "model.layers.0.mlp.experts.down_proj": ((4, 32, 64), True)}
    assert report["model.layers.0.mlp.router"].status == "kept"
    assert type(model.model.layers[0].mlp.experts.gate_up_proj_bias) is torch.nn.Parameter
    float_model = dequantized_copy(model)
    for impl in IMPLEMENTATIONS:
        torch.testing.assert_close(_logits(model, impl), _logits(float_model, impl), atol=2e-5, rtol=0)

