"""Quantization-aware training: fake quantization equals the converted weights bit for bit, STE / clipped-STE
gradients, ModuleConfigs, torch.compile, save / load mid-training, and the errors."""
from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from test.common import MLP

REF = qk.KernelPreference.REFERENCE
# Every kind of config a fake quantizer emulates (weight-only integer / float8 / MX / NF4, dynamic int8 and float8
# activations, static float8 activations), on the reference kernel path (dequantize + F.linear), the one the
# training forward computes.
CONFIGS = {
    "int8-wo": qk.Int8WeightOnlyConfig(kernel_preference=REF),
    "int4-g32": qk.Int4WeightOnlyConfig(group_size=32, kernel_preference=REF),
    "int4-g64-hqq": qk.Int4WeightOnlyConfig(group_size=64, algorithm="hqq", kernel_preference=REF),
    "int3-asym": qk.IntxWeightOnlyConfig(bits=3, mapping="asymmetric", kernel_preference=REF),
    "int8da-int8": qk.Int8DynamicActivationInt8WeightConfig(kernel_preference=REF),
    "int8da-int4": qk.Int8DynamicActivationIntxWeightConfig(kernel_preference=REF),
    "fp8-wo": qk.Float8WeightOnlyConfig(kernel_preference=REF),
    "fp8-dyn-row": qk.Float8DynamicActivationFloat8WeightConfig(kernel_preference=REF),
    "fp8-dyn-tensor": qk.Float8DynamicActivationFloat8WeightConfig(granularity=qk.PerTensor(), kernel_preference=REF),
    "fp8-static": qk.Float8StaticActivationFloat8WeightConfig(act_scale=0.01, kernel_preference=REF),
    "mxfp8": qk.MXFP8WeightOnlyConfig(kernel_preference=REF),
    "mxfp4": qk.MXFP4WeightOnlyConfig(kernel_preference=REF),
    "nvfp4": qk.NVFP4WeightOnlyConfig(kernel_preference=REF),
    "nvfp4-dyn-nvfp4": qk.NVFP4DynamicActivationNVFP4WeightConfig(kernel_preference=REF),
    "fp6-e3m2": qk.FP6WeightOnlyConfig(kernel_preference=REF),
    "fp6-e2m3-g32": qk.FP6WeightOnlyConfig(ebits=2, group_size=32, kernel_preference=REF),
    "nf4-dq": qk.NF4WeightOnlyConfig(double_quant=True, kernel_preference=REF),
}


def _model(seed=0):
    torch.manual_seed(seed)
    return MLP(dim=128, hidden=256, out=64)


def _x(seed=1):
    return torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(seed))


def _train_steps(model, steps=2, lr=1e-2):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i in range(steps):
        model(_x(10 + i)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_convert_gives_the_last_training_forward_bit_for_bit(name):
    model = _model()
    qk.prepare_qat_(model, qk.QATConfig(CONFIGS[name]))
    _train_steps(model)
    fake = {n: m.qat.weight_quantizer.values(m.weight)[0] for n, m in model.named_modules()
            if isinstance(m, qk.FakeQuantizedLinear)}
    with torch.no_grad():
        before = model(_x())
    report = qk.convert_qat_(model)
    assert [e.fqn for e in report.quantized] == ["up", "down"]
    assert type(model.up) is nn.Linear and isinstance(model.up.weight, qk.AffineQuantizedTensor)
    for n, w in fake.items():
        assert torch.equal(getattr(model, n).weight.dequantize(), w), n
    with torch.no_grad():
        assert torch.equal(model(_x()), before)


def test_convert_on_the_auto_kernels_keeps_the_weights_and_stays_within_kernel_tolerance():
    model = _model()
    qk.prepare_qat_(model, qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32)))
    _train_steps(model)
    fake = model.up.qat.weight_quantizer.values(model.up.weight)[0]
    with torch.no_grad():
        before = model(_x())
    qk.convert_qat_(model)
    assert torch.equal(model.up.weight.dequantize(), fake)
    with torch.no_grad():
        after = model(_x())
    # The int4 kernel accumulates in another order than F.linear: float32 rounding only.
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()


def test_ste_gradient_is_the_gradient_at_the_fake_weights():
    model = _model()
    qk.prepare_qat_(model, qk.QATConfig(qk.IntxWeightOnlyConfig(bits=2, granularity=qk.PerGroup(32))))
    x = _x()
    model(x).square().mean().backward()
    w_up = model.up.qat.weight_quantizer.values(model.up.weight)[0].requires_grad_(True)
    w_down = model.down.qat.weight_quantizer.values(model.down.weight)[0].requires_grad_(True)
    F.linear(torch.relu(F.linear(x, w_up, model.up.bias)), w_down).square().mean().backward()
    assert torch.equal(model.up.weight.grad, w_up.grad)
    assert torch.equal(model.down.weight.grad, w_down.grad)
    assert not torch.equal(w_up.detach(), model.up.weight.detach())  # 2-bit: the fake weights really differ


def test_clipped_ste_zeroes_the_gradient_of_clipped_weights_only():
    # Symmetric int4 per row: scale = amax / 7.5, so +amax sits half a step past code 7 and is clipped; -amax is
    # code -8 exactly. Every other weight lies inside the grid.
    w = torch.tensor([[0.5, -0.1, 0.2, 0.05], [-0.3, 0.3, 0.1, -0.2]])
    grads = {}
    for rule in ("ste", "clipped_ste"):
        lin = nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        qk.prepare_qat_(lin, qk.QATConfig(qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerRow()), grad=rule),
                        filter_fn=lambda m, f: True)
        lin(torch.ones(1, 4)).sum().backward()
        grads[rule] = lin.weight.grad
    assert torch.equal(grads["ste"], torch.ones(2, 4))
    assert torch.equal(grads["clipped_ste"], torch.tensor([[0.0, 1, 1, 1], [1, 0, 1, 1]]))


def test_clipped_ste_on_static_activation_scales():
    # float8 e4m3 with static scale 1e-3: |x| > 0.448 saturates. Those inputs get no gradient under clipped_ste.
    x = torch.linspace(-1, 1, 64).reshape(2, 32)
    grads = {}
    for rule in ("ste", "clipped_ste"):
        torch.manual_seed(0)
        lin = nn.Linear(32, 16)
        qk.prepare_qat_(lin, qk.QATConfig(qk.Float8StaticActivationFloat8WeightConfig(act_scale=1e-3), grad=rule),
                        filter_fn=lambda m, f: True)
        xi = x.clone().requires_grad_(True)
        lin(xi).sum().backward()
        grads[rule] = xi.grad
    clipped = x.abs() > 448 * 1e-3
    assert 0 < int(clipped.sum()) < x.numel()
    assert torch.equal(grads["clipped_ste"][clipped], torch.zeros(int(clipped.sum())))
    assert torch.equal(grads["clipped_ste"][~clipped], grads["ste"][~clipped])
    assert (grads["ste"][clipped] != 0).all()


def test_compiled_training_step_matches_eager():
    config = qk.QATConfig(qk.Int8DynamicActivationInt8WeightConfig(), grad="clipped_ste")
    eager, compiled = _model(), _model()
    qk.prepare_qat_(eager, config)
    qk.prepare_qat_(compiled, config)
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    step = torch.compile(loss_fn, fullgraph=True)
    x = _x()
    a, b = loss_fn(eager, x), step(compiled, x)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_save_and_load_mid_training_plain_float_state_dict_and_config():
    config = qk.QATConfig(qk.ModuleConfigs({"down": None, "_default": qk.Int4WeightOnlyConfig(group_size=64)}),
                          grad="clipped_ste")
    model = _model()
    qk.prepare_qat_(model, config)
    _train_steps(model)
    assert set(model.state_dict()) == set(_model().state_dict())  # the float model's keys, nothing added
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    text = json.dumps(config.to_dict())

    resumed = _model(seed=5)
    qk.prepare_qat_(resumed, qk.QATConfig.from_dict(json.loads(text)))
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert isinstance(resumed.up, qk.FakeQuantizedLinear) and type(resumed.down) is nn.Linear
    with torch.no_grad():
        assert torch.equal(resumed(_x()), model(_x()))
    _train_steps(model, 1)
    _train_steps(resumed, 1)
    assert torch.equal(resumed.up.weight, model.up.weight)


def test_module_configs_choose_layers_and_the_report_says_so():
    model = _model()
    report = qk.prepare_qat_(model, qk.QATConfig(qk.ModuleConfigs({"up": qk.Int8WeightOnlyConfig()})))
    assert [(e.fqn, e.status) for e in report.entries] == [("up", "quantized"), ("down", "kept")]
    assert isinstance(model.up, qk.FakeQuantizedLinear) and type(model.down) is nn.Linear
    assert "fake_quant=int8 weight-only per-channel, grad=ste" in repr(model.up)
    report = qk.convert_qat_(model)
    assert [e.fqn for e in report.quantized] == ["up"] and type(model.down.weight) is nn.Parameter


def test_stochastic_rounding_moves_between_grid_neighbours():
    lin = nn.Linear(64, 8, bias=False)
    qk.prepare_qat_(lin, qk.QATConfig(qk.IntxWeightOnlyConfig(bits=4), stochastic_rounding=True, seed=3),
                    filter_fn=lambda m, f: True)
    quantizer = lin.qat.weight_quantizer
    draws = torch.stack([quantizer.values(lin.weight)[0] for _ in range(64)])
    rtn = qk.quantize_weight(lin.weight.detach(), Q.int4, qk.PerGroup(32), qk.PlainLayout()).dequantize()
    assert not torch.equal(draws[0], draws[1])
    step = (rtn.reshape(8, 2, 32).amax(-1) - rtn.reshape(8, 2, 32).amin(-1)).max() / 15
    assert ((draws - lin.weight.detach()).abs() <= step * 1.01).all()  # up or down, never further
    # Unbiased: the mean of 64 draws is nearer the float weights than round-to-nearest is, on average.
    assert (draws.mean(0) - lin.weight).abs().mean() < (rtn - lin.weight).abs().mean()


# ------------------------------------------------------------------------------------------ errors

def test_prepare_refuses_a_quantized_model_and_names_the_weight():
    model = _model()
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match=r"up\.weight is already quantized .*prepare the float model"):
        qk.prepare_qat_(model, qk.QATConfig(qk.Int8WeightOnlyConfig()))


def test_prepare_twice_and_convert_without_prepare_raise():
    model = _model()
    with pytest.raises(ValueError, match=r"convert_qat_: no layer .* call prepare_qat_"):
        qk.convert_qat_(model)
    qk.prepare_qat_(model, qk.QATConfig(qk.Int8WeightOnlyConfig()))
    with pytest.raises(ValueError, match=r"up is already prepared"):
        qk.prepare_qat_(model, qk.QATConfig(qk.Int8WeightOnlyConfig()))


def test_configs_a_fake_quantizer_cant_emulate_are_refused_naming_the_modules():
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"stochastic_rounding .* up, down .*float8_e4m3fn"):
        qk.prepare_qat_(model, qk.QATConfig(qk.Float8WeightOnlyConfig(), stochastic_rounding=True))
    with pytest.raises(TypeError, match=r"prepare_qat_ takes a QATConfig.*wrap it: QATConfig\(Int8WeightOnlyConfig"):
        qk.prepare_qat_(model, qk.Int8WeightOnlyConfig())
    assert type(model.up) is nn.Linear and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_weight_tied_to_an_embedding_is_refused_and_the_model_left_alone():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.proj = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, 64, bias=False)
            self.lm_head.weight = self.embed.weight

    model = Tied()
    config = qk.QATConfig(qk.ModuleConfigs({"lm_head": qk.Int8WeightOnlyConfig(), "_default": qk.Int8WeightOnlyConfig()}))
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied to embed\.weight \(Embedding\)"):
        qk.prepare_qat_(model, config)
    assert type(model.proj) is nn.Linear and type(model.lm_head) is nn.Linear
    # Named only by _default, the tied head stays in float, as quantize_ leaves it.
    report = qk.prepare_qat_(model, qk.QATConfig(qk.Int8WeightOnlyConfig()))
    assert report["lm_head"].status == "kept" and isinstance(model.proj, qk.FakeQuantizedLinear)


def test_strict_prepare_leaves_the_model_unchanged_when_a_layer_cant_be_quantized():
    model = _model()
    with torch.no_grad():
        model.down.weight[0, 0] = float("nan")
    with pytest.raises(qk.QuantizationError, match=r"down: .*NaN"):
        qk.prepare_qat_(model, qk.QATConfig(qk.Int8WeightOnlyConfig()), strict=True)
    assert type(model.up) is nn.Linear
    with pytest.warns(UserWarning, match=r"1 selected layer\(s\) stay in float"):
        report = qk.prepare_qat_(model, qk.QATConfig(qk.Int8WeightOnlyConfig()))
    assert report["down"].status == "skipped" and type(model.down) is nn.Linear


def test_qat_config_checks_and_round_trips():
    with pytest.raises(ValueError, match="grad must be one of"):
        qk.QATConfig(qk.Int8WeightOnlyConfig(), grad="lsq")
    with pytest.raises(TypeError, match="base must be a quantization config"):
        qk.QATConfig("int4")
    c = qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32), grad="clipped_ste", stochastic_rounding=True, seed=7)
    assert qk.QATConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_gpt2_conv1d_layers_are_reported_not_trained():
    """quantize_ serves GPT-2's Conv1D, fake quantization doesn't: prepare_qat_ reports them skipped with the reason
    and leaves them (and their outputs) exactly as they were; strict=True raises before changing anything."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.arange(16).reshape(1, 16)
    before = model(ids).logits
    qat = qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32))
    with pytest.raises(qk.QuantizationError, match="transformer.h.0.attn.c_attn: quantization-aware training"):
        qk.prepare_qat_(model, qat, strict=True)
    with pytest.warns(UserWarning, match="4 selected layer"):
        report = qk.prepare_qat_(model, qat)
    entry = report["transformer.h.0.mlp.c_fc"]
    assert entry.status == "skipped" and "not Conv1D weights yet" in entry.reason
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "Conv1D"
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
