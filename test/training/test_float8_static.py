"""float8 training with recipe="static" (Note [Static float8 training scales]): fixed per-tensor scales given or set
by a calibration pass, the three matmuls against products of operands cast here with torch's own float8 casts and
the same fixed scales (saturating), the saturation counts, the state dict, torch.compile, and the errors."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import torchqkit as qk

E4M3 = torch.float8_e4m3fn
# The emulated products multiply the same float8 values in float32 as computed here: summation order apart.
EXACT = dict(rtol=1e-6, atol=1e-6)


def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _cast_static(t, dtype, scale):
    """t cast to float8 with a fixed scale, values past scale * max saturating, dequantized."""
    fmax = torch.finfo(dtype).max
    return (t / scale).clamp(-fmax, fmax).to(dtype).float() * scale


def _saturated(t, dtype, scale):
    """(elements that saturate, largest |t / scale| as a multiple of the format's max)."""
    ratio = (t / scale).abs()
    fmax = torch.finfo(dtype).max
    return int((ratio > fmax).sum()), float(ratio.max() / fmax)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))


@pytest.mark.parametrize("grad_dtype", ["float8_e5m2", "float8_e4m3fn"], ids=["e5m2-grads", "e4m3-grads"])
def test_given_scales_cast_saturate_and_are_counted(grad_dtype):
    G = getattr(torch, grad_dtype)
    model, ref = _model(), _model()
    lin = ref[0]
    x, g = _randn(10, 32, seed=1), _randn(10, 48, seed=2, scale=1e-3)
    w = lin.weight.detach()
    # Half the amax of each tensor: its larger values saturate.
    scales = qk.Float8StaticScales(input=float(x.abs().max()) / 448 / 2, weight=float(w.abs().max()) / 448 / 2,
                                   grad_output=float(g.abs().max()) / torch.finfo(G).max / 2)
    qk.enable_float8_training_(model, "static", grad_dtype=grad_dtype, static_scales={"0": scales, "2": scales})
    sx, sw, sg = (torch.tensor(v, dtype=torch.float32) for v in (scales.input, scales.weight, scales.grad_output))
    xr = x.clone().requires_grad_()
    y = model[0](xr)
    y.backward(g)
    want_y = _cast_static(x, E4M3, sx) @ _cast_static(w, E4M3, sw).t() + lin.bias.detach()
    torch.testing.assert_close(y.detach(), want_y, **EXACT)
    torch.testing.assert_close(xr.grad, _cast_static(g, G, sg) @ _cast_static(w, E4M3, sw), **EXACT)
    torch.testing.assert_close(model[0].weight.grad, _cast_static(g.t(), G, sg) @ _cast_static(x, E4M3, sx), **EXACT)
    report = qk.float8_training_overflows(model)
    assert list(report) == ["0", "2"] and report["2"]["input"] == {"casts": 0.0, "elements": 0.0, "peak": 0.0}
    for name, t, dtype, s in (("input", x, E4M3, sx), ("weight", w, E4M3, sw), ("grad_output", g, G, sg)):
        elements, peak = _saturated(t, dtype, s)
        assert elements > 0 and report["0"][name]["casts"] == 1.0 and report["0"][name]["elements"] == elements
        assert report["0"][name]["peak"] == pytest.approx(peak, rel=1e-6) and peak > 1
    model[0](x).backward(g)  # a second step adds to the counts
    assert qk.float8_training_overflows(model)["0"]["input"]["casts"] == 2.0
    assert qk.float8_training_overflows(model)["0"]["input"]["elements"] == 2 * _saturated(x, E4M3, sx)[0]


def test_calibration_sets_scales_from_the_observed_amax():
    model, ref = _model(), _model()
    qk.enable_float8_training_(model, "static", grad_dtype="float8_e4m3fn")
    batches = [_randn(8, 32, seed=s) for s in (3, 4)]
    with pytest.raises(RuntimeError, match=r"^0: float8 training with recipe='static' has no scales yet; pass "
                                           r"static_scales="):
        model(batches[0])
    # What the calibration must see: the float model's tensors, grad_output taken at each Linear's output.
    seen = {0: torch.zeros(3), 2: torch.zeros(3)}
    outs = {}

    def watch(i):
        def hook(module, inputs, out):
            outs[i] = out
            out.retain_grad()
            seen[i][0] = max(seen[i][0], inputs[0].abs().max())
            seen[i][1] = module.weight.detach().abs().max()
        return hook

    for i in (0, 2):
        ref[i].register_forward_hook(watch(i))
    with qk.float8_training_calibration(model, margin=2.0):
        for x in batches:
            model(x).square().mean().backward()
            ref(x).square().mean().backward()
            for i in (0, 2):
                seen[i][2] = max(seen[i][2], outs[i].grad.abs().max())
    for i in (0, 2):  # e4m3 for all three tensors here: scale = 2 * amax / 448
        torch.testing.assert_close(model[i].fp8_static_scales, 2 * seen[i] / 448, rtol=1e-6, atol=0)
        assert model[i].fp8.static_ready and model[i].fp8.calibration_amax is None
    # The float matmuls ran inside the block (the gradients equal the float model's); fixed scales now.
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad, rtol=1e-5, atol=1e-7)
    model.zero_grad()
    model(batches[0]).square().mean().backward()  # the calibration data, with 2x headroom: nothing saturates
    assert all(v["casts"] == 0 and 0.25 < v["peak"] <= 0.5 for t in qk.float8_training_overflows(model).values()
               for v in t.values())


def test_a_layer_missed_by_the_calibration_is_named_and_left_unset():
    model = nn.ModuleDict({"used": nn.Linear(32, 16), "unused": nn.Linear(32, 16)})
    qk.enable_float8_training_(model, "static")
    x = _randn(4, 32, seed=5)
    with pytest.raises(ValueError, match=r"1 layer\(s\) saw no \(or no finite\) values of: unused \(input, weight, "
                                         r"grad_output\)"):
        with qk.float8_training_calibration(model):
            model["used"](x).sum().backward()
    assert not model["used"].fp8.static_ready and not model["unused"].fp8.static_ready  # nothing was set
    assert torch.equal(model["used"].fp8_static_scales, torch.zeros(3))
    with pytest.raises(ValueError, match=r"used \(grad_output\)"):  # a forward without a backward
        with qk.float8_training_calibration(model):
            with torch.no_grad():
                model["used"](x)
                model["unused"](x)
    with pytest.raises(ZeroDivisionError):  # an error inside the block leaves the layers as they were
        with qk.float8_training_calibration(model):
            model["used"](x)
            raise ZeroDivisionError
    assert model["used"].fp8.calibration_amax is None and not model["used"].fp8.static_ready


def test_static_scales_save_and_load_and_the_loaded_model_runs():
    a, b = _model(), _model()
    qk.enable_float8_training_(a, "static", static_scales=qk.Float8StaticScales(input=0.01, weight=0.001,
                                                                                grad_output=1e-9))
    qk.enable_float8_training_(b, "static")
    state = a.state_dict()
    assert "0.fp8_static_scales" in state and "0.fp8_overflow" not in state  # the counts are not state
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b[0].fp8.static_ready
    x = _randn(4, 32, seed=6)
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


def test_compiled_static_step_matches_eager():
    scales = qk.Float8StaticScales(input=3.0 / 448, weight=0.1 / 448, grad_output=1e-3 / 448)
    eager, compiled = _model(), _model()
    for m in (eager, compiled):
        qk.enable_float8_training_(m, "static", grad_dtype="float8_e4m3fn", static_scales=scales)
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    x = _randn(4, 32, seed=7, scale=2.0)
    a, b = loss_fn(eager, x), torch.compile(loss_fn, fullgraph=True)(compiled, x)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    torch.testing.assert_close(compiled[0].weight.grad, eager[0].weight.grad, rtol=1e-5, atol=1e-8)
    got, want = qk.float8_training_overflows(compiled), qk.float8_training_overflows(eager)
    for layer in want:  # the same counts; the peaks to float32 rounding (inductor's GELU differs in the last bit)
        for t in want[layer]:
            assert got[layer][t]["casts"] == want[layer][t]["casts"]
            assert got[layer][t]["elements"] == want[layer][t]["elements"]
            assert got[layer][t]["peak"] == pytest.approx(want[layer][t]["peak"], rel=1e-6)
    assert qk.float8_training_overflows(eager)["0"]["input"]["casts"] == 1.0  # |x| reaches past 3 somewhere


def test_bad_input_is_refused_and_leaves_the_model_unchanged():
    scales = qk.Float8StaticScales(input=1.0, weight=1.0, grad_output=1.0)
    cases = [
        (dict(recipe="static", granularity="row"), ValueError, "static scaling keeps one scale per tensor"),
        (dict(recipe="dynamic", static_scales=scales), ValueError, "static_scales are the scales of recipe='static'"),
        (dict(recipe="static", static_scales={"0": scales}), ValueError,
         r"static_scales must name exactly the converted layers; missing: \['2'\]"),
        (dict(recipe="static", static_scales={"0": scales, "2": scales, "1": scales}), ValueError,
         r"not converted \(no such Linear, not selected, or skipped\): \['1'\]"),
        (dict(recipe="static", static_scales={"0": scales, "2": 0.5}), TypeError,
         r"static_scales\['2'\] must be a Float8StaticScales"),
        (dict(recipe="static", static_scales=[scales]), TypeError, "must be a Float8StaticScales or a dict"),
        (dict(grad_dtype="float8_e4m3fnuz"), ValueError,
         r"grad_dtype must be one of \['float8_e5m2', 'float8_e4m3fn'\]"),
        (dict(grad_dtype="int8"), ValueError, "grad_dtype must be one of"),
    ]
    for kwargs, error, match in cases:
        model = _model()
        recipe = kwargs.pop("recipe", "dynamic")
        with pytest.raises(error, match=match):
            qk.enable_float8_training_(model, recipe, **kwargs)
        assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear and not hasattr(model[0], "fp8")
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="input must be a finite number > 0"):
            qk.Float8StaticScales(input=bad, weight=1.0, grad_output=1.0)
    with pytest.raises(ValueError, match="the model has no layer trained with recipe='static'"):
        with qk.float8_training_calibration(_model()):
            pass
    dynamic = _model()
    qk.enable_float8_training_(dynamic)
    with pytest.raises(ValueError, match="the model has no layer trained with recipe='static'"):
        qk.float8_training_overflows(dynamic)
    static = _model()
    qk.enable_float8_training_(static, "static")
    for margin in (0.0, -2.0, float("nan"), True):
        with pytest.raises(ValueError, match="margin must be a finite number > 0"):
            with qk.float8_training_calibration(static, margin=margin):
                pass
    assert static[0].fp8.calibration_amax is None
