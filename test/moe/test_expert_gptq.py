"""GPTQ of expert Parameters (Note [Expert calibration], torchqkit/api/calibrate_experts.py) on tiny random Qwen3-MoE
and Mixtral models: per-expert Hessians from the routed tokens beat round-to-nearest on the calibration data, an
expert no token reaches is rounded to nearest and named, routers stay float, and the quantized model computes the
float model built from its dequantized weights.

Error measure: the mean squared error of the first decoder layer's MoE block output (its input is the same for
every model: nothing before it is quantized) against the float model's, over the calibration batches, int4 with
groups of 32. Measured GPTQ / RTN ratios: qwen3_moe 0.46, mixtral 0.61 (asserted below 0.6 and 0.75).
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchqkit as qk

from ..common import dequantized_copy
from .models import expert_stacks, tiny_moe

BASE = qk.Int4WeightOnlyConfig(group_size=32)
BATCHES = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
EXPERTS_ONLY = "re:.*experts.*"


def _experts(config) -> qk.ModuleConfigs:
    return qk.ModuleConfigs({EXPERTS_ONLY: config, "_default": None})


def _moe_outputs(model, batches) -> list[torch.Tensor]:
    """The first layer's MoE block output for each batch."""
    outs = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: outs.append(out.detach().clone()))
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        handle.remove()
    return outs


def _mse(outs, refs) -> float:
    return sum(((o - r) ** 2).mean().item() for o, r in zip(outs, refs)) / len(refs)


def _routed(model, batches) -> set[int]:
    """Experts the first layer's router sends at least one calibration token to."""
    hit: set[int] = set()
    experts = model.model.layers[0].mlp.experts

    def hook(module, args, kwargs):
        hit.update(args[1].unique().tolist())
    handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        handle.remove()
    return hit


@pytest.mark.parametrize("name,bound", [("qwen3_moe", 0.6), ("mixtral", 0.75)])
def test_gptq_experts_beat_rtn_on_calibration_data(name, bound):
    model = tiny_moe(name)
    reference = _moe_outputs(model, BATCHES)
    rtn, gptq = copy.deepcopy(model), copy.deepcopy(model)
    qk.quantize_(rtn, _experts(BASE))
    report = qk.quantize_(gptq, _experts(qk.GPTQConfig(BASE)), calibration_data=BATCHES)
    ratio = _mse(_moe_outputs(gptq, BATCHES), reference) / _mse(_moe_outputs(rtn, BATCHES), reference)
    assert ratio < bound, f"{name}: GPTQ / RTN output MSE {ratio:.3f}"
    for attr in ("gate_up_proj", "down_proj"):
        entry = report[f"model.layers.1.mlp.experts.{attr}"]
        assert entry.status == "quantized" and entry.config == "gptq (int4 weight-only g32)"
        assert "gptq per expert on its routed tokens" in entry.reason and "round-to-nearest" not in entry.reason
    # the same format as round-to-nearest: only the codes differ
    for fqn, stack in expert_stacks(gptq).items():
        other = dict(rtn.named_parameters())[fqn]
        assert stack.attributes() == other.attributes() and stack.logical_shape == other.logical_shape


def test_expert_without_tokens_is_rounded_to_nearest_and_named():
    model = tiny_moe("qwen3_moe")
    few = [torch.tensor([[5, 17, 99]])]  # 3 tokens x top-2 reach at most 6 of the 8 experts of a layer
    missing = sorted(set(range(8)) - _routed(model, few))
    assert len(missing) >= 2
    rtn = copy.deepcopy(model)
    qk.quantize_(rtn, _experts(BASE))
    report = qk.quantize_(model, _experts(qk.GPTQConfig(BASE)), calibration_data=few, strict=True)
    fqn = "model.layers.0.mlp.experts.gate_up_proj"
    entry = report[fqn]
    assert entry.status == "quantized"
    assert (f"experts {', '.join(map(str, missing))} of 8 of {fqn} got no calibration tokens: round-to-nearest"
            in entry.reason)
    got, want = dict(model.named_parameters())[fqn], dict(rtn.named_parameters())[fqn]
    for e in range(8):  # the missing experts: exactly the RTN bytes; the others: GPTQ's own codes
        same = all(torch.equal(a, b) for a, b in zip(got[e].inner_tensors().values(), want[e].inner_tensors().values())
                   if a is not None)
        assert same == (e in missing), f"expert {e}"


def test_logits_equal_the_dequantized_float_model_and_routers_stay_float():
    model = tiny_moe("mixtral")
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp.gate." in n}
    report = qk.quantize_(model, qk.GPTQConfig(BASE), calibration_data=BATCHES[:2])
    assert {e.fqn for e in report.quantized if "experts" in e.fqn} == {
        f"model.layers.{i}.mlp.experts.{a}" for i in range(2) for a in ("gate_up_proj", "down_proj")}
    assert report["model.layers.0.self_attn.q_proj"].config == "gptq (int4 weight-only g32)"
    for n, p in model.named_parameters():
        if n in routers:
            assert not isinstance(p, qk.AffineQuantizedTensor) and torch.equal(p, routers[n]), n
    float_model = dequantized_copy(model)
    with torch.no_grad():
        for b in BATCHES[2:]:
            torch.testing.assert_close(model(b).logits, float_model(b).logits, atol=2e-5, rtol=0)


def test_smoothquant_experts_refused_strict_leaves_model_alone():
    """A structure SmoothQuant can't calibrate (gpt-oss: transposed, biased experts) under strict=True raises before
    anything changes, attention and folds included."""
    model = tiny_moe("gpt_oss")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(qk.QuantizationError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: SmoothQuant of "
                                                   r"expert Parameters knows experts computing"):
        qk.quantize_(model, qk.SmoothQuantConfig(), calibration_data=BATCHES[:1], strict=True)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_structure_gptq_does_not_know_is_skipped_with_the_reason():
    model = tiny_moe("gpt_oss")
    with pytest.warns(UserWarning, match="4 selected layer"):
        report = qk.quantize_(model, _experts(qk.GPTQConfig(BASE)), calibration_data=BATCHES[:1])
    entry = report["model.layers.0.mlp.experts.gate_up_proj"]
    assert entry.status == "skipped"
    assert "GptOssExperts is another structure" in entry.reason and "weight-only config" in entry.reason
    assert not expert_stacks(model)


def test_layer0_stacks_do_not_depend_on_the_experts_implementation():
    # the first layer's inputs (and so its Hessians) are the same whichever implementation runs the experts
    stacks = {}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        model = tiny_moe("qwen3_moe")
        model.set_experts_implementation(impl)
        qk.quantize_(model, _experts(qk.GPTQConfig(BASE)), calibration_data=BATCHES[:2])
        stacks[impl] = {n: p for n, p in expert_stacks(model).items() if ".layers.0." in n}
    for impl in ("grouped_mm", "batched_mm"):
        for fqn, stack in stacks["eager"].items():
            for name, t in stack.inner_tensors().items():
                if t is not None:
                    assert torch.equal(t, stacks[impl][fqn].inner_tensors()[name]), (impl, fqn, name)


class _LinearRouter(torch.nn.Linear):
    """A router that is an nn.Linear (as in some MoE models): logits, top-k weights and ids."""

    def __init__(self, router):
        super().__init__(router.weight.shape[1], router.weight.shape[0], bias=False)
        self.weight = router.weight
        self.top_k = router.top_k

    def forward(self, x):
        logits = super().forward(x)
        weights, ids = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(x.dtype), ids


def test_linear_router_stays_float_while_calibrating():
    model = tiny_moe("qwen3_moe")
    seen = []
    for layer in model.model.layers:
        layer.mlp.gate = _LinearRouter(layer.mlp.gate)
        layer.mlp.gate.register_forward_pre_hook(
            lambda m, a: seen.append(isinstance(m.weight, qk.AffineQuantizedTensor)))
    report = qk.quantize_(model, qk.GPTQConfig(BASE), calibration_data=BATCHES[:1])
    assert seen and not any(seen)  # float on every call, during calibration and after
    assert report["model.layers.1.mlp.gate"].status == "kept"
    assert report["model.layers.1.mlp.experts.down_proj"].config == "gptq (int4 weight-only g32)"
