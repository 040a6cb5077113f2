"""Quantization-aware training of mixture-of-experts expert stacks (Note [Fake-quantized experts]) on tiny random
Qwen3-MoE, Mixtral, OLMoE and gpt-oss (stacks stored transposed) models: training through every transformers experts
implementation, straight-through gradients, convert_qat_ giving the last forward's stacks bit for bit, ModuleConfigs,
torch.compile, and the errors.

Tolerance: after convert_qat_ the int4 experts run on the layout's kernel, which adds in another order than the
float matmuls of the training forward: logits (magnitude ~0.5) agree within float32 rounding, 2e-5 absolute (as in
test/moe/test_moe_models.py; measured about 2e-6). Everything else here is compared exactly."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.api.configs.base import recipe_for
from torchqkit.api.expert_weights import quantize_experts
from torchqkit.api.quantize_weight import weight_qparams
from torchqkit.training import is_qat_prepared
from torchqkit.training.fake_quantize import WeightFakeQuantizer

from ..common import one_torch_thread  # noqa: F401  (autouse: tiny models run on one thread)
from ..moe.models import IMPLEMENTATIONS, expert_stacks, tiny_moe
from .test_qat import CONFIGS

INT4 = qk.Int4WeightOnlyConfig(group_size=32)
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
STACKS = [f"model.layers.{layer}.mlp.experts.{attr}" for layer in (0, 1) for attr in ("gate_up_proj", "down_proj")]


def _experts(model) -> dict[str, nn.Module]:
    return {fqn: m for fqn, m in model.named_modules() if fqn.endswith("mlp.experts")}


def _fake_stacks(model) -> dict[str, torch.Tensor]:
    """Each trained stack as the next forward will read it (the module's orientation)."""
    return {f"{fqn}.{attr}": m.qat.values(m, attr) for fqn, m in _experts(model).items()
            if isinstance(m, qk.FakeQuantizedExperts) for attr in m.qat.weights}


def _train(model, steps=3, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_training_moves_the_stacks_and_convert_stores_the_last_forward_bit_for_bit(name, impl):
    model = tiny_moe(name).train()
    model.set_experts_implementation(impl)
    float_keys = set(model.state_dict())
    experts = model.model.layers[0].mlp.experts
    original, float_stack = type(experts), experts.gate_up_proj.detach().clone()
    report = qk.prepare_qat_(model, qk.QATConfig(INT4), strict=True)
    assert all(report[f].status == "quantized" for f in STACKS)  # trained, converted by convert_qat_
    assert isinstance(experts, qk.FakeQuantizedExperts) and isinstance(experts, original)
    assert type(experts.gate_up_proj) is nn.Parameter  # outside the forward: the float Parameter
    assert set(model.state_dict()) == float_keys and is_qat_prepared(model)

    losses = _train(model)
    assert losses[-1] < losses[0]
    assert not torch.equal(experts.gate_up_proj.detach(), float_stack)  # SGD moved the float stack
    fakes = _fake_stacks(model)
    assert set(fakes) == set(STACKS)
    with torch.no_grad():
        trained = model(IDS).logits
    converted = qk.convert_qat_(model)
    assert [e.fqn for e in converted.entries if e.fqn in STACKS and e.status == "quantized"] == STACKS
    assert type(experts) is original and not hasattr(experts, "qat")
    stacks = expert_stacks(model)
    assert set(stacks) == set(STACKS)
    for fqn, fake in fakes.items():
        assert torch.equal(stacks[fqn].dequantize(), fake), fqn
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, trained, atol=2e-5, rtol=0)


def _float_twin_at_fake_stacks(model):
    """A copy of the prepared model restored to its float classes, each stack replaced by its fake values."""
    twin = copy.deepcopy(model)
    fakes = _fake_stacks(twin)
    for fqn, m in _experts(twin).items():
        for attr in m.qat.weights:
            m._parameters[attr] = nn.Parameter(fakes[f"{fqn}.{attr}"])
        m.__class__ = m.qat.original_class
        del m.qat
    return twin


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_ste_gradient_of_a_stack_is_the_gradient_at_its_fake_values(name, impl):
    model = tiny_moe(name)
    model.set_experts_implementation(impl)
    qk.prepare_qat_(model, qk.QATConfig(qk.ModuleConfigs({"re:.*experts.*": qk.IntxWeightOnlyConfig(bits=2)})))
    twin = _float_twin_at_fake_stacks(model)
    model(IDS, labels=IDS).loss.backward()
    twin(IDS, labels=IDS).loss.backward()
    for fqn, m in _experts(model).items():
        ref = _experts(twin)[fqn]
        for attr in ("gate_up_proj", "down_proj"):
            grad = m._parameters[attr].grad
            assert grad is not None and grad.abs().sum() > 0
            assert torch.equal(grad, ref._parameters[attr].grad), f"{fqn}.{attr}"
            assert not torch.equal(ref._parameters[attr], m._parameters[attr])  # 2 bits: the fake stack differs


def test_clipped_ste_zeroes_the_gradient_of_clipped_expert_weights_only():
    # Symmetric int4 per row: +amax sits half a step past code 7 (clipped), every other weight inside the grid.
    config = qk.ModuleConfigs({"re:.*experts.*": qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerRow())})
    grads = {}
    for rule in ("ste", "clipped_ste"):
        model = tiny_moe("gpt_oss")
        qk.prepare_qat_(model, qk.QATConfig(config, grad=rule))
        model(IDS, labels=IDS).loss.backward()
        experts = model.model.layers[0].mlp.experts
        grads[rule] = experts.down_proj.grad
        quantizer = experts.qat.weights["down_proj"].quantizer
        inside = quantizer.values(experts.down_proj.transpose(-2, -1))[1]  # gpt-oss stores (E, K, N)
    clipped = ~inside.transpose(-2, -1)
    assert 0 < int(clipped.sum()) < clipped.numel()
    assert torch.equal(grads["clipped_ste"][clipped], torch.zeros(int(clipped.sum())))
    assert torch.equal(grads["clipped_ste"][~clipped], grads["ste"][~clipped])


# Recipes chosen in one call on the stack, and those run expert by expert (HQQ, NVFP4's global scale, NF4's double
# quantization): Note [Fake-quantized experts]
@pytest.mark.parametrize("config", ["int8-wo", "int3-asym", "fp8-wo", "mxfp4", "int4-g64-hqq", "nvfp4", "nf4-dq"])
def test_every_kind_of_recipe_converts_to_the_last_forward(config):
    model = tiny_moe("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    qk.prepare_qat_(model, qk.QATConfig(qk.ModuleConfigs({"re:.*experts.*": CONFIGS[config]})), strict=True)
    _train(model, steps=1)
    fakes = _fake_stacks(model)
    qk.convert_qat_(model)
    stacks = expert_stacks(model)
    assert all(torch.equal(stacks[fqn].dequantize(), fake) for fqn, fake in fakes.items())


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_one_call_on_a_stack_equals_quantizing_expert_by_expert(config):
    """The fake quantizer's (E, N, K) path against quantize_experts (the config's handler per expert) for every
    config kind, on experts of very different magnitudes (statistics shared across experts would show)."""
    magnitudes = torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    stack = torch.randn(3, 48, 96, generator=torch.Generator().manual_seed(2)) * magnitudes
    recipe = recipe_for(CONFIGS[config])
    fake, inside = WeightFakeQuantizer(recipe, clipped=True).values(stack)
    assert torch.equal(fake, quantize_experts(CONFIGS[config], stack, "w").dequantize())
    assert inside.shape == stack.shape
    if not recipe.blockwise:
        with pytest.raises(ValueError, match="choose them expert by expert"):
            weight_qparams(stack, recipe, experts=True)


def test_stochastic_rounding_on_stacks_is_seeded_and_stays_within_one_step():
    config = qk.QATConfig(qk.ModuleConfigs({"re:.*experts.*": qk.IntxWeightOnlyConfig(bits=4)}),
                          stochastic_rounding=True, seed=3)
    a, b = tiny_moe("mixtral"), tiny_moe("mixtral")
    qk.prepare_qat_(a, config)
    qk.prepare_qat_(b, config)
    ea, eb = a.model.layers[0].mlp.experts, b.model.layers[0].mlp.experts
    first, second = ea.qat.values(ea, "down_proj"), ea.qat.values(ea, "down_proj")
    assert not torch.equal(first, second)  # a new draw each forward
    assert torch.equal(first, eb.qat.values(eb, "down_proj"))  # the same seed, the same draws
    w = ea.down_proj.detach()
    recipe = recipe_for(qk.IntxWeightOnlyConfig(bits=4))
    qp = recipe.qparams(w, experts=True)
    step = qp.scale.repeat_interleave(qp.block_size[-1], -1)
    assert ((first - w).abs() < step).all()  # rounded up or down, never further
    rtn = quantize_experts(qk.IntxWeightOnlyConfig(bits=4), w, "w").dequantize()
    assert not torch.equal(first, rtn)


def test_module_configs_name_expert_stacks_as_quantize_does():
    model = tiny_moe("olmoe")
    configs = qk.ModuleConfigs({"model.layers.0.mlp.experts.down_proj": None,
                                "re:.*experts.*": qk.Int8WeightOnlyConfig(), "_default": None})
    report = qk.prepare_qat_(model, qk.QATConfig(configs), strict=True)
    assert report["model.layers.0.mlp.experts.down_proj"].status == "kept"
    assert report["model.layers.0.self_attn.q_proj"].status == "kept"
    layer0 = model.model.layers[0].mlp.experts
    assert set(layer0.qat.weights) == {"gate_up_proj"} and "down_proj" not in type(layer0).__dict__
    assert "fake_quant: gate_up_proj=int8 weight-only per-channel, grad=ste" in repr(layer0)
    assert set(model.model.layers[1].mlp.experts.qat.weights) == {"gate_up_proj", "down_proj"}
    assert not any(isinstance(m, qk.FakeQuantizedLinear) for m in model.modules())
    _train(model, steps=1)
    converted = qk.convert_qat_(model)
    assert sorted(e.fqn for e in converted.quantized) == sorted(set(STACKS) - {"model.layers.0.mlp.experts.down_proj"})
    assert set(expert_stacks(model)) == {f.fqn for f in converted.quantized}


@pytest.mark.parametrize("impl,fullgraph", [("grouped_mm", True), ("batched_mm", True), ("eager", False)])
def test_compiled_training_step_matches_eager(impl, fullgraph):
    """Compile of the block's loss, traced with aot_eager (the same graph capture without inductor's C++ build, to
    keep the file fast); fullgraph but for the "eager" experts, whose loop over ``nonzero()`` breaks any graph
    (test/moe/test_moe_compile.py)."""
    config = qk.QATConfig(INT4, grad="clipped_ste")
    eager, compiled = tiny_moe("qwen3_moe"), tiny_moe("qwen3_moe")
    for m in (eager, compiled):
        m.set_experts_implementation(impl)
        qk.prepare_qat_(m, config)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    loss_fn = lambda block, x: block(x).square().mean()  # noqa: E731
    step = torch.compile(loss_fn, fullgraph=fullgraph, backend="aot_eager")
    blocks = eager.model.layers[0].mlp, compiled.model.layers[0].mlp
    # fullgraph: the second call reuses the graph (the eager experts recompile per expert's token count, as float)
    with torch._dynamo.config.patch(error_on_recompile=fullgraph):
        for _ in range(2):
            a, b = loss_fn(blocks[0], x), step(blocks[1], x)
            a.backward()
            b.backward()
            assert torch.equal(a, b)
    for attr in ("gate_up_proj", "down_proj"):
        g_eager, g_compiled = (getattr(b.experts, attr).grad for b in blocks)
        assert g_eager.abs().sum() > 0 and torch.equal(g_compiled, g_eager), attr
    assert blocks[1].experts.qat.fakes is None  # nothing of the forward is kept


def test_resume_from_the_float_state_dict():
    config = qk.QATConfig(INT4)
    model = tiny_moe("qwen3_moe").train()
    qk.prepare_qat_(model, config)
    _train(model, steps=2)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    resumed = tiny_moe("qwen3_moe", seed=5).train()
    qk.prepare_qat_(resumed, config)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert _fake_stacks(resumed).keys() == _fake_stacks(model).keys()
    assert all(torch.equal(v, _fake_stacks(model)[k]) for k, v in _fake_stacks(resumed).items())
    with torch.no_grad():
        assert torch.equal(resumed(IDS).logits, model(IDS).logits)


# ------------------------------------------------------------------------------------------ errors

def _untouched(model, before) -> bool:
    params = dict(model.named_parameters())
    return (not is_qat_prepared(model) and params.keys() == before.keys()
            and all(type(params[n]) is nn.Parameter and torch.equal(params[n], p) for n, p in before.items()))


def test_activation_quantizing_configs_leave_the_stacks_float_with_the_reason():
    config = qk.QATConfig(qk.Int8DynamicActivationInt8WeightConfig())
    model = tiny_moe("qwen3_moe")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(qk.QuantizationError, match=r"model.layers.0.mlp.experts.gate_up_proj: quantization-aware "
                                                   r"training fake-quantizes expert stacks' weights, not the "
                                                   r"activations"):
        qk.prepare_qat_(model, config, strict=True)
    assert _untouched(model, before)
    with pytest.warns(UserWarning, match="4 selected layer"):
        report = qk.prepare_qat_(model, config)
    assert all(report[f].status == "skipped" and "weight-only config" in report[f].reason for f in STACKS)
    assert report["model.layers.1.self_attn.q_proj"].status == "quantized"
    assert not any(isinstance(m, qk.FakeQuantizedExperts) for m in model.modules())
    converted = qk.convert_qat_(model)
    assert len(converted.quantized) == 9 and not expert_stacks(model)


def test_a_config_without_a_recipe_is_refused_naming_the_stacks():
    model = tiny_moe("mixtral")
    before = {n: p.clone() for n, p in model.named_parameters()}
    gptq = qk.GPTQConfig(qk.Int4WeightOnlyConfig(group_size=32))
    with pytest.raises(TypeError, match=r"can't emulate the config for model.layers.0.mlp.experts.gate_up_proj"):
        qk.prepare_qat_(model, qk.QATConfig(qk.ModuleConfigs({"re:.*experts.*": gptq, "_default": INT4})))
    assert _untouched(model, before)


def test_a_stack_the_layout_cant_take_fails_strict_before_anything_changes():
    model = tiny_moe("qwen3_moe")
    with torch.no_grad():  # expert 3's values are too large for the int4 tiled kernel's float32 sums
        model.model.layers[0].mlp.experts.down_proj[3] = torch.randn(64, 32) * 1e37
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(qk.QuantizationError, match=r"model.layers.0.mlp.experts.down_proj: model.layers.0.mlp."
                                                   r"experts.down_proj\[3\]: TensorCoreTiledLayout's kernels"):
        qk.prepare_qat_(model, qk.QATConfig(INT4), strict=True)
    assert _untouched(model, before)
    with pytest.warns(UserWarning, match=r"experts.down_proj\[3\]"):
        report = qk.prepare_qat_(model, qk.QATConfig(INT4))
    assert report["model.layers.0.mlp.experts.down_proj"].status == "skipped"
    assert set(model.model.layers[0].mlp.experts.qat.weights) == {"gate_up_proj"}


def test_prepared_or_quantized_experts_are_refused_by_name():
    experts_only = qk.QATConfig(qk.ModuleConfigs({"re:.*experts.*": INT4}))
    model = tiny_moe("qwen3_moe")
    qk.prepare_qat_(model, experts_only)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts is already prepared .*int4"):
        qk.prepare_qat_(model, experts_only)
    model = tiny_moe("qwen3_moe")
    qk.quantize_(model, qk.ModuleConfigs({"re:.*experts.*": INT4}))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj is already quantized"):
        qk.prepare_qat_(model, experts_only)
