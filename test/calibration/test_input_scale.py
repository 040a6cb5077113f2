"""AWQ / SmoothQuant scales kept on the layer (``input_scale``) where no previous op can absorb them: LLaMA's
o_proj behind grouped KV heads. The scale is layer data of the quantized weight: eager, torch.compile,
checkpoints, slicing along K and sharding all carry it (see Note [Input scale])."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk

from ..eval.models import tiny_llama

INT8_DYNAMIC = qk.Int8DynamicActivationInt8WeightConfig()
O_PROJ = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama(vocab_size=96)
    with torch.no_grad():  # outlier channels in q/k/v's and in o_proj's inputs (v_proj rows)
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] = 12.0
            layer.self_attn.v_proj.weight[:2] *= 30.0
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (6, 48), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def smoothed(llama, ids):
    q = copy.deepcopy(llama)
    report = qk.quantize_(q, qk.ModuleConfigs({"lm_head": None, "_default": qk.SmoothQuantConfig(INT8_DYNAMIC)}),
                          calibration_data=[ids[i:i + 1] for i in range(4)])
    return q, report


def _rel_err(model, q, ids):
    with torch.no_grad():
        ref, out = model(ids[:4]).logits, q(ids[:4]).logits
    return float((out - ref).square().mean() / ref.square().mean())


def test_o_proj_keeps_its_smoothing_scales_and_they_help(llama, ids, smoothed):
    q, report = smoothed
    w = q.get_submodule(O_PROJ).weight
    assert "kept on the layer as its input_scale" in report[O_PROJ].reason
    assert w.input_scale is not None and w.input_scale.shape == (w.shape[1],)
    assert q.model.layers[0].self_attn.q_proj.weight.input_scale is None  # folded into the norm instead
    # o_proj's own output error on its float inputs, against o_proj plain int8-dynamic (v_proj's outliers unsmoothed)
    x = _o_proj_input(llama, ids)
    with torch.no_grad():
        ref = F.linear(x, llama.get_submodule(O_PROJ).weight)
        err = float((F.linear(x, w) - ref).square().mean() / ref.square().mean())
        plain = F.linear(x, _quantized(llama.get_submodule(O_PROJ), INT8_DYNAMIC))
        plain_err = float((plain - ref).square().mean() / ref.square().mean())
    assert err < 0.5 * plain_err  # measured 4.2e-5 against 1.15e-4


def _o_proj_input(model, ids):
    seen = []
    handle = model.get_submodule(O_PROJ).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(ids[4:])
    finally:
        handle.remove()
    return seen[0]


def _quantized(linear, config):
    q = copy.deepcopy(linear)
    qk.quantize_(q, config)
    return q.weight


def test_awq_keeps_o_proj_scales_too(llama, ids):
    q = copy.deepcopy(llama)
    report = qk.quantize_(q, qk.ModuleConfigs({"lm_head": None, "_default": qk.AWQConfig(
        qk.Int4WeightOnlyConfig(group_size=32), clip=False)}), calibration_data=[ids[i:i + 1] for i in range(2)])
    assert "awq: scales mean|x|^" in report[O_PROJ].reason and "input_scale" in report[O_PROJ].reason
    assert q.get_submodule(O_PROJ).weight.input_scale is not None


def test_linear_multiplies_the_input_and_dequantize_includes_the_scale(smoothed):
    w = smoothed[0].get_submodule(O_PROJ).weight
    codes_only = w.with_changes({"input_scale": None})
    x = torch.randn(3, 5, w.shape[1], generator=torch.Generator().manual_seed(1))
    assert torch.equal(F.linear(x, w), F.linear(x * w.input_scale, codes_only))
    assert torch.equal(w.dequantize(), codes_only.dequantize() * w.input_scale)
    assert repr(w).endswith(f"kernel=auto, input_scale=({w.shape[1]},))")
    with pytest.raises(ValueError, match="input_scale multiplies the 32 input features.*got a torch.float32 tensor "
                                         "of shape \\(7,\\)"):
        codes_only.with_changes({"input_scale": torch.ones(7)})


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
@torch.no_grad()
def test_compile_and_checkpoints_serve_the_scale(llama, ids, smoothed, tmp_path):
    q, _ = smoothed
    eager = q(ids[4:]).logits
    compiled = torch.compile(q, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids[4:]).logits, eager, rtol=1e-5, atol=1e-5)

    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    fresh = copy.deepcopy(llama)
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    assert torch.equal(fresh(ids[4:]).logits, eager)

    qk.save_quantized(q, tmp_path / "q.safetensors")
    loaded = qk.load_quantized(copy.deepcopy(llama), tmp_path / "q.safetensors")
    assert torch.equal(loaded.get_submodule(O_PROJ).weight.input_scale, q.get_submodule(O_PROJ).weight.input_scale)
    assert torch.equal(loaded(ids[4:]).logits, eager)

    qk.save_pretrained(q, tmp_path / "hf", config=qk.SmoothQuantConfig(INT8_DYNAMIC))
    assert torch.equal(qk.from_pretrained(tmp_path / "hf")(ids[4:]).logits, eager)
    from transformers import AutoModelForCausalLM
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids[4:]).logits, eager)


@pytest.mark.filterwarnings("ignore:sharding a weight with dynamic activation quantization")
def test_slicing_along_k_cuts_the_scale_and_along_n_keeps_it(smoothed):
    w = smoothed[0].get_submodule(O_PROJ).weight  # (32, 32) int8 per row: any K range is one block
    full = w.dequantize()
    left = w[:, :16]
    assert torch.equal(left.input_scale, w.input_scale[:16]) and torch.equal(left.dequantize(), full[:, :16])
    top = w[:8]
    assert torch.equal(top.input_scale, w.input_scale) and torch.equal(top.dequantize(), full[:8])
    # what RowwiseParallel's distribute_tensor does: aten.split along in_features
    pieces = torch.split(w, 16, dim=1)
    assert [torch.equal(p.input_scale, w.input_scale[i * 16:(i + 1) * 16]) for i, p in enumerate(pieces)] == [True] * 2
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    summed = F.linear(x[:, :16], pieces[0]) + F.linear(x[:, 16:], pieces[1])
    # int8 dynamic activations: each K half is quantized against its own range, so only close
    torch.testing.assert_close(summed, F.linear(x, w), rtol=0.05, atol=0.05)
