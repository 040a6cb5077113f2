"""int4 and MXFP8 dynamic activations: Int4DynamicActivationInt4WeightConfig, Float8DynamicActivationInt4WeightConfig,
MXDynamicActivationMXWeightConfig and the ActivationQuantSpec cases under them."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.layouts.routes import route_for

from ..common import OpLog, dequantized_copy, sqnr
from ..eval.models import tiny_llama

CONFIGS = {
    "w4a4": qk.Int4DynamicActivationInt4WeightConfig(group_size=16),
    "w4a4-act-groups": qk.Int4DynamicActivationInt4WeightConfig(group_size=16, act_group_size=16),
    "w4a4-asym-per-channel": qk.Int4DynamicActivationInt4WeightConfig(group_size=None, act_mapping="asymmetric"),
    "fp8-int4": qk.Float8DynamicActivationInt4WeightConfig(group_size=16),
    "e5m2-int4": qk.Float8DynamicActivationInt4WeightConfig(group_size=None, act_dtype="float8_e5m2"),
    "mxfp8-mxfp4": qk.MXDynamicActivationMXWeightConfig(weight="mxfp4"),
    "mxfp8-mxfp8": qk.MXDynamicActivationMXWeightConfig(weight="mxfp8"),
}


def test_int4_activation_codes_are_exact():
    spec = qk.ActivationQuantSpec(Q.int4, qk.PerToken())
    x = torch.tensor([[1.5, -3.0, 0.75, 3.0, 0.0, -1.0]])
    qa = spec.quantize(x)
    # symmetric int4: scale = max|x| / 7.5 = 0.4; x / 0.4 rounded half to even, clamped to [-8, 7]
    assert torch.equal(qa.scale, torch.tensor([[0.4]])) and qa.zero_point is None
    assert qa.qdata.tolist() == [[4, -8, 2, 7, 0, -2]]
    grouped = qk.ActivationQuantSpec(Q.int4, qk.PerGroup(3)).quantize(x)
    torch.testing.assert_close(grouped.scale, torch.tensor([[3.0 / 7.5, 3.0 / 7.5]]))


def test_mxfp8_activation_scales_are_powers_of_two_per_32():
    spec = qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerGroup(32))
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1], x[0, 40], x[1, 5] = 3.0, 0.3, -100.0, 1e-3
    qa = spec.quantize(x)
    # OCP MX: scale = 2^(floor(log2(amax)) - 8) (e4m3's largest exponent); empty blocks get scale 1
    assert qa.scale.tolist() == [[2.0 ** -7, 2.0 ** -2], [2.0 ** -18, 1.0]]
    assert qa.qdata.dtype == torch.float8_e4m3fn
    assert qa.qdata.float()[0, [0, 40]].tolist() == [384.0, -384.0]  # -400 rounds to even: 384, not 416


def _fake_quantizing_reference(model):
    """The reference of a quantized model: every Linear's weight dequantized, its input fake-quantized by the weight's
    ActivationQuantSpec (quantize, dequantize), then a float32 F.linear."""
    reference = dequantized_copy(model)
    for (fqn, m), ref_m in zip(model.named_modules(), reference.modules()):
        if isinstance(m, torch.nn.Linear):
            spec = m.weight.act_quant
            assert spec is not None, fqn
            ref_m.register_forward_pre_hook(
                lambda mod, args, spec=spec: (spec.fake_quantize(args[0].reshape(-1, args[0].shape[-1]))
                                              .reshape(args[0].shape),))
    return reference


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_on_the_reference_path_are_the_reference(name):
    model = tiny_llama(tied=False)
    config = dataclasses.replace(CONFIGS[name], kernel_preference=qk.KernelPreference.REFERENCE)
    report = qk.quantize_(model, config, strict=True)
    assert len(report.quantized) == 15  # 2 x 7 Linears and the lm_head
    reference = _fake_quantizing_reference(model)
    ids = torch.arange(40).reshape(2, 20)
    with torch.no_grad():
        out, ref, plain = model(ids).logits, reference(ids).logits, tiny_llama(tied=False)(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert (out - plain).abs().max() > 1e-3 * plain.abs().max()  # quantized: not the float model


@pytest.mark.parametrize("name", CONFIGS)
def test_every_linear_of_the_model_is_its_reference(name):
    # The kernels sum in another order than F.linear, and a 4-bit activation code that flips on a last-bit
    # difference changes the next layer's output by a whole step: so each Linear is compared with its reference on
    # the input it was given, and the logits are as far from the float model's as the reference model's are (W4A4
    # on this random model: 6.3 vs 6.5 dB, while the two models' logits are 11.9 dB apart).
    model = tiny_llama(tied=False)
    qk.quantize_(model, CONFIGS[name], strict=True)
    reference = _fake_quantizing_reference(model)
    checked = []

    def check(mod, args, out, fqn):
        ref = F.linear(mod.weight.act_quant.fake_quantize(args[0].reshape(-1, args[0].shape[-1])),
                       mod.weight.dequantize(), mod.bias).reshape(out.shape)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item(), msg=fqn)
        checked.append(fqn)
    for fqn, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out, fqn=fqn: check(mod, args, out, fqn))
    ids = torch.arange(40).reshape(2, 20)
    with torch.no_grad():
        out, ref, plain = model(ids).logits, reference(ids).logits, tiny_llama(tied=False)(ids).logits
    assert len(checked) == 15
    assert abs(sqnr(plain, out) - sqnr(plain, ref)) < 1.0


@pytest.mark.parametrize("name,act,op", [
    # int4 codes are int8 codes of a smaller range: the integer kernel quantizes them itself (act_bits = 4)
    ("w4a4", "int4 PerToken symmetric dynamic", "linear_int8da_int4_packed"),
    ("w4a4-act-groups", "int4 PerGroup symmetric dynamic", "linear_int8da_int4_packed"),
    ("w4a4-asym-per-channel", "int4 PerToken asymmetric dynamic", "linear_int8da_int4_packed"),
    # no CPU instruction multiplies float8: the weight-only kernel on the fake-quantized input
    ("fp8-int4", "float8_e4m3fn PerRow symmetric dynamic", "linear_intxwo"),
    ("mxfp8-mxfp4", "float8_e4m3fn PerGroup symmetric dynamic", "linear_mxwo"),
    ("mxfp8-mxfp8", "float8_e4m3fn PerGroup symmetric dynamic", "linear_mxwo")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_config_runs_its_kernel(name, act, op, dtype):
    lin = torch.nn.Linear(64, 32)
    qk.quantize_(lin, CONFIGS[name], strict=True)
    w = lin.weight
    assert str(w.act_quant) == act
    x = torch.randn(3, 5, 64, dtype=dtype)
    assert route_for(w, x).op == f"torchqkit::{op}"
    with OpLog() as log:
        y = lin(x)
    assert log.ops.count(op) == 1
    if op != "linear_int8da_int4_packed":  # the int8 x int4 kernel quantizes to integers itself: never float8
        assert "linear_int8da_int4_packed" not in log.ops
    ref = F.linear(w.act_quant.fake_quantize(x.reshape(-1, 64)), w.dequantize().to(dtype),
                   lin.bias.to(dtype)).reshape(3, 5, 32)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, ref, rtol=0, atol=tol * ref.abs().max().item())


def test_int8_activations_still_take_the_int8_kernel():
    lin = torch.nn.Linear(64, 32)
    qk.quantize_(lin, qk.Int8DynamicActivationIntxWeightConfig(weight_granularity=qk.PerGroup(32)), strict=True)
    assert route_for(lin.weight, torch.randn(2, 64)).op == "torchqkit::linear_int8da_int4_packed"


def test_int4_activations_per_group_other_than_the_weights_run_the_weight_only_kernel():
    # the integer kernel takes activation groups equal to the weight's only: other groups are fake-quantized
    lin = torch.nn.Linear(64, 32)
    qk.quantize_(lin, qk.Int4DynamicActivationInt4WeightConfig(group_size=32, act_group_size=16), strict=True)
    x = torch.randn(4, 64)
    assert route_for(lin.weight, x).op == "torchqkit::linear_intxwo"
    ref = F.linear(lin.weight.act_quant.fake_quantize(x), lin.weight.dequantize(), lin.bias)
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=1e-6 * ref.abs().max().item())


def test_int8_activations_the_int8_kernel_cannot_take_run_the_weight_only_kernel():
    # int8 activations x int4 weights per 24 (not a group the int8 x int4 kernel reads): the activations are
    # fake-quantized for linear_intxwo
    lin = torch.nn.Linear(96, 32)
    qk.quantize_(lin, qk.Int8DynamicActivationIntxWeightConfig(weight_granularity=qk.PerGroup(24)), strict=True)
    x = torch.randn(4, 96)
    assert route_for(lin.weight, x).op == "torchqkit::linear_intxwo"
    ref = F.linear(lin.weight.act_quant.fake_quantize(x), lin.weight.dequantize(), lin.bias)
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=1e-6 * ref.abs().max().item())


def test_status_lists_the_fake_quantized_rows():
    rows = {(r["layout"], r["linear"]): r["path"] for r in qk.kernels.status()}
    intx = [path for (layout, case), path in rows.items()
            if layout == "packed_intx" and case.startswith("any other activation quantization")]
    mx = [path for (layout, case), path in rows.items()
          if layout == "mx" and case.startswith("MXFP8 / MXFP4 weights x MXFP8 dynamic activations")]
    assert len(intx) == 1 and intx[0].startswith("torchqkit::linear_intxwo")
    assert len(mx) == 1 and mx[0].startswith("torchqkit::linear_mxwo")


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_round_trip_through_json(name):
    config = CONFIGS[name]
    assert qk.config_from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_checkpoints_keep_the_activation_spec(tmp_path):
    model = tiny_llama(tied=False)
    qk.quantize_(model, qk.ModuleConfigs({"model.layers.0.mlp.down_proj": CONFIGS["mxfp8-mxfp4"],
                                          "_default": CONFIGS["w4a4-act-groups"]}), strict=True)
    qk.save_quantized(model, tmp_path / "m.safetensors")
    loaded = qk.load_quantized(tiny_llama(tied=False), tmp_path / "m.safetensors")
    for fqn in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
        assert loaded.get_submodule(fqn).weight.act_quant == model.get_submodule(fqn).weight.act_quant
    ids = torch.arange(20).reshape(1, 20)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("build,error,message", [
    (lambda: qk.Int4DynamicActivationInt4WeightConfig(act_group_size=32, act_mapping="asymmetric"), ValueError,
     "quantized symmetrically"),
    (lambda: qk.Int4DynamicActivationInt4WeightConfig(group_size=0), ValueError, "group_size must be >= 1"),
    (lambda: qk.Float8DynamicActivationInt4WeightConfig(act_dtype="int8"), ValueError, "act_dtype must be float8"),
    (lambda: qk.MXDynamicActivationMXWeightConfig(weight="mxfp6"), ValueError, "weight must be one of"),
    (lambda: qk.MXDynamicActivationMXWeightConfig(activation="mxfp4"), ValueError, "activation must be one of"),
    (lambda: qk.ActivationQuantSpec(Q.int4, qk.PerTensor(), static_scale=1.0), ValueError, "int4 activations are "
     "quantized with dynamic scales"),
    (lambda: qk.ActivationQuantSpec(Q.int4, qk.PerGroup(16), "asymmetric"), ValueError, "quantized symmetrically"),
    (lambda: qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerGroup(16)), ValueError, r"MXFP8: PerGroup\(32\)"),
    (lambda: qk.ActivationQuantSpec(Q.int2), ValueError, "int8 or int4, got int2"),
], ids=["w4a4-group-asym", "w4a4-group-0", "fp8-int8", "mx-weight", "mx-act", "int4-static", "int4-group-asym",
        "fp8-group-16", "int2"])
def test_bad_input_is_refused(build, error, message):
    with pytest.raises(error, match=message):
        build()
