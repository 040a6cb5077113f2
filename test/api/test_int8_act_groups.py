"""Int8DynamicActivationIntxWeightConfig with llama.cpp's arithmetic: int8 activations with a scale per token and
weight group (act_granularity=PerGroup), int4 weights with float zero points (weight_zero_point_domain="float",
GGUF Q4_1's w = q s + z) and 16-bit scales; their checks, files, compiled graphs and SmolLM2 end to end."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import torchqkit as qk
from torchqkit.demo import DEMO_CONFIGS
from torchqkit.layouts.routes import reference_linear, route_for

from ..common import op_calls


def q41_config(**kw) -> qk.Int8DynamicActivationIntxWeightConfig:
    """The shipped config: int4 g32 with GGUF Q4_1's float minimum x int8 activations per token and group of 32
    (Q8_1); fields in kw replaced (and checked again)."""
    return dataclasses.replace(DEMO_CONFIGS["int8-dyn-g32-int4-q41"](), **kw)


def test_config_checks_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"act_granularity PerGroup\(group_size=64\) must match weight_granularity"):
        q41_config(act_granularity=qk.PerGroup(64))
    with pytest.raises(ValueError, match="quantizes activations symmetrically; pass act_mapping='symmetric'"):
        q41_config(act_mapping="asymmetric")
    with pytest.raises(ValueError, match=r"act_granularity must be PerToken\(\) or PerGroup\(n\)"):
        q41_config(act_granularity=qk.PerTensor())
    with pytest.raises(ValueError, match="weight_zero_point_domain='float' doesn't go with weight_mapping='symmetric'"):
        q41_config(weight_mapping="symmetric")
    # symmetric_no_clipping_err is symmetric: no zero points
    config = q41_config(weight_mapping="symmetric_no_clipping_err", weight_zero_point_domain="none")
    assert config.weight_zero_point_domain.value == "none"
    with pytest.raises(ValueError, match="weight_scale_dtype"):
        q41_config(weight_scale_dtype="float64")
    with pytest.raises(ValueError, match="int8 activations per group .* are quantized symmetrically"):
        qk.ActivationQuantSpec(qk.qdtypes.int8, qk.PerGroup(32), "asymmetric")
    assert q41_config().describe() == ("int8 dynamic act per group x int4 weight g32 asymmetric float zero, "
                                       "float16 scales")


def _q41_linear(k=576, n=48, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    plain = copy.deepcopy(lin)
    qk.quantize_(lin, q41_config())
    return lin, plain


def test_linear_routes_to_the_integer_kernel_and_matches_its_definition():
    lin, plain = _q41_linear()
    w = lin.weight
    assert w.scale.dtype == w.zero_point.dtype == torch.float16 and w.act_quant.group_size == 32
    for m in (1, 5, 40):  # decode passes and the panel paths
        x = torch.randn(m, 576) * torch.linspace(0.1, 4, 576)
        assert route_for(w, x).op == "torchqkit::linear_int8da_int4_packed"
        with torch.no_grad():
            out, ref = lin(x), reference_linear(w, x, lin.bias)
        torch.testing.assert_close(out, ref, rtol=0, atol=2e-6 * ref.abs().max().item())  # summation order
        # the oracle: activations fake-quantized per (token, group of 32), weights dequantized
        qa = w.act_quant.quantize(x)
        assert qa.scale.shape == (m, 576 // 32) and qa.zero_point is None
        err = ((out - plain(x).detach()).norm() / plain(x).detach().norm()).item()
        assert err < 0.12, err  # int4 g32 of a random weight: measured 0.085


def test_save_and_load_keep_the_activation_groups(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    qk.quantize_(model, q41_config())
    path = tmp_path / "m.safetensors"
    qk.save_quantized(model, path)
    fresh = qk.load_quantized(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)),
                              path)
    assert fresh[0].weight.act_quant == model[0].weight.act_quant
    assert fresh[2].weight.zero_point.dtype == torch.float16
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_file_entry_of_the_activation_groups_is_checked():
    from torchqkit.serialization.entries import decode_entry, encode_entry

    lin, _ = _q41_linear(k=64, n=8)
    entry = encode_entry(lin.weight)
    assert entry["act_quant"]["granularity"] == {"type": "PerGroup", "group_size": 32}
    assert decode_entry(entry)["act_quant"] == lin.weight.act_quant
    for bad, message in (({"type": "PerGroup"}, "must be one of"), ({"type": "PerGroup", "group_size": 0},
                         "PerGroup needs a positive int group_size"), ({"type": "PerGroup", "group_size": "32"},
                         "PerGroup needs a positive int group_size"), ({"type": "PerToken", "group_size": 32},
                         "must be one of")):
        broken = {**entry, "act_quant": {**entry["act_quant"], "granularity": bad}}
        with pytest.raises(ValueError, match=message):
            decode_entry(broken)


def test_compiled_fullgraph_calls_the_op_with_the_group_size():
    lin, _ = _q41_linear(k=128, n=24)
    x = torch.randn(2, 128)
    from torch._inductor.utils import run_and_get_code
    compiled = torch.compile(lin, fullgraph=True)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, x)
        ref = lin(x)
    assert op_calls("\n".join(code), "linear_int8da_int4_packed") == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 * ref.abs().max().item())


def test_smollm2_keeps_the_q4_1_weights_and_their_perplexity():
    # The packaged GGUF is Q4_1: transformers dequantizes it to float, and float zero points quantize every Linear
    # back onto the file's own grid (float16 scales and zeros, as Q4_1 stores them); integer zero points can't
    # (Note [int8 x int4 float zero points]). Perplexity over the first 128 tokens of the eval text, measured:
    # float 84.7, float zero points with activations per group 96.5 (1.14x), integer zero points 119.6 (1.41x).
    from torchqkit.eval import eval_text, load_gguf, perplexity, smollm2_gguf_path

    base, tokenizer = load_gguf(smollm2_gguf_path())
    ids = tokenizer(eval_text(), return_tensors="pt").input_ids[0][:128]
    results = {}
    for name, config in (("float", None), ("float zero", q41_config()), ("int zero", q41_config(
            weight_zero_point_domain=None, weight_scale_dtype=None))):
        model = copy.deepcopy(base)
        if config is not None:
            report = qk.quantize_(model, qk.ModuleConfigs({"lm_head": config, "_default": config}), strict=True)
            assert len(report.quantized) == 211  # 30 layers x 7 Linears and the lm_head
            assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        with torch.inference_mode():
            results[name] = perplexity(model, ids, window=128, progress=False)
        if name == "float zero":
            w0, w1 = base.model.layers[5].mlp.down_proj.weight, model.model.layers[5].mlp.down_proj.weight
            assert (w1.dequantize() - w0).abs().max() < 1e-3 * w0.abs().max()  # the file's grid, up to float16 z
            x = torch.randn(1, 1536)
            assert route_for(w1, x).op == "torchqkit::linear_int8da_int4_packed"
    assert results["float zero"] < 1.2 * results["float"], results
    assert results["int zero"] > 1.3 * results["float"], results
