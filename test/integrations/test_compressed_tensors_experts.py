"""compressed-tensors export and import of quantized MoE expert stacks: one Linear per expert (and per gate / up
half), named as transformers' save_pretrained splits fused experts, checked with compressed_tensors' own
decompressor, re-imported by torchqkit (same codes, same logits) and loaded by transformers without torchqkit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchqkit as qk

from ..moe.models import expert_stacks, tiny_moe
from .test_compressed_tensors import _HF_LOAD

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 127, 0, 64]])

# Groups of 16 divide both K of the experts (hidden 64, moe intermediate 32): gate_up_proj and down_proj get one
# scheme, as vLLM wants of an experts module's three projections.
CONFIGS = {
    "int4_g16_asym": lambda: qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(16), mapping="asymmetric"),
    "int4_g16_sym": lambda: qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(16)),
    "int8_weight_only": lambda: qk.Int8WeightOnlyConfig(),
    "w8a8_int": lambda: qk.Int8DynamicActivationInt8WeightConfig(),
    "fp8_weight_only": lambda: qk.Float8WeightOnlyConfig(),
    "mxfp4": lambda: qk.MXFP4WeightOnlyConfig(),
    "nvfp4": lambda: qk.NVFP4WeightOnlyConfig(),
}
# What transformers' save_pretrained calls the Linears of expert e (tiny_moe: 8 experts, Mixtral 4).
SAVED = {"qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
         "mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                     "block_sparse_moe.experts.{e}.w2")}


def _quantized(name, key, dtype=torch.float32):
    model = tiny_moe(name).to(dtype)
    qk.quantize_(model, CONFIGS[key](), strict=True)
    return model


def _pieces(model, name):
    """(saved module name, stack, expert, rows) of every expert Linear the export should write."""
    out = []
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts
        e_count, n2 = experts.gate_up_proj.shape[:2]
        gate, up, down = (f"model.layers.{layer}.{s}" for s in SAVED[name])
        for e in range(e_count):
            out.append((gate.format(e=e), experts.gate_up_proj, e, slice(0, n2 // 2)))
            out.append((up.format(e=e), experts.gate_up_proj, e, slice(n2 // 2, n2)))
            out.append((down.format(e=e), experts.down_proj, e, slice(None)))
    return out


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_expert_linears_decompressed_by_compressed_tensors_bit_exact(tmp_path, key):
    """Every expert's gate / up / down Linear, decompressed by compressed_tensors' own compressor with the scheme of
    the config group whose targets match it (compressed_tensors' own matching), equals those rows of the stack."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.utils.match import match_name
    model = _quantized("qwen3_moe", key)
    export = qk.save_compressed_tensors(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert not [k for k in stored if k.endswith("gate_up_proj") or k.endswith("experts.down_proj")]  # no fused keys
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    pieces = _pieces(model, "qwen3_moe")
    assert len(pieces) == 2 * 8 * 3
    for module, stack, e, rows in pieces:
        groups = [g for g in qc["config_groups"].values() if any(match_name(module, t) for t in g["targets"])]
        assert len(groups) == 1, (module, groups)
        assert not any(match_name(module, t) for t in qc["ignore"])
        group = groups[0]
        scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
        local = {k[len(module) + 1:]: v for k, v in stored.items() if k.startswith(module + ".")}
        theirs = BaseCompressor.load_from_registry(group["format"]).decompress(local, scheme)["weight"]
        assert torch.equal(theirs, stack.dequantize(theirs.dtype)[e, rows]), module
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]
    assert r"re:^model\.layers\.0\.mlp\.experts\.\d+\.gate_proj$" in targets  # one target per module and piece
    assert any(n.startswith("model.layers.1.mlp.experts.7.down_proj.") and what.endswith("exact")
               for n, what in export.tensors)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("key", ["int4_g16_asym", "w8a8_int", "fp8_weight_only", "nvfp4"])
def test_export_reimports_the_same_stacks_and_logits(tmp_path, name, key):
    """torchqkit.from_pretrained joins each expert's Linears back into the stack: the same codes (dequantized bit for
    bit, activation spec kept) and the same logits, under Mixtral's saved names (block_sparse_moe, w1 / w3 / w2)
    too. An imported NVFP4 stack is bfloat16 (compressed-tensors' dtype for NVFP4), and transformers' "grouped_mm"
    experts cast their input to the weight's dtype: compared with "eager" and "batched_mm" there."""
    model = _quantized(name, key)
    qk.save_compressed_tensors(model, tmp_path)
    assert f"model.layers.0.{SAVED[name][1].format(e=1)}.weight_scale" in load_file(tmp_path / "model.safetensors")
    loaded = qk.from_pretrained(tmp_path)
    ours, theirs = expert_stacks(model), expert_stacks(loaded)
    assert sorted(ours) == sorted(theirs) and len(ours) == 4
    for fqn, stack in ours.items():
        back = theirs[fqn]
        assert back.shape == stack.shape and back.is_experts
        assert torch.equal(back.dequantize(), stack.dequantize()), fqn
        assert (back.act_quant is None) == (stack.act_quant is None), fqn
        assert loaded.torchqkit_report[fqn].status == "quantized"
    for impl in ("eager", "batched_mm") if key == "nvfp4" else ("eager", "grouped_mm"):
        model.set_experts_implementation(impl)
        loaded.set_experts_implementation(impl)
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, loaded(IDS).logits), impl


def test_float_experts_are_written_per_expert_and_ignored(tmp_path):
    """Experts kept float (ModuleConfigs None) are split like transformers' save does, listed in ignore, and read
    back into the fused Parameter."""
    model = tiny_moe("qwen3_moe")
    int8 = qk.Int8WeightOnlyConfig()
    qk.quantize_(model, qk.ModuleConfigs({"_default": int8, "re:.*experts.*": None}), strict=True)
    qk.save_compressed_tensors(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(stored["model.layers.0.mlp.experts.3.up_proj.weight"], w[3, 32:])
    ignore = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    assert r"re:^model\.layers\.1\.mlp\.experts\.\d+\.down_proj$" in ignore
    loaded = qk.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.layers[0].mlp.experts.gate_up_proj, w)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, loaded(IDS).logits)


def test_stacks_without_an_exact_form_are_refused_naming_the_expert_linear(tmp_path):
    model = tiny_moe("qwen3_moe")
    qk.quantize_(model, qk.ModuleConfigs({"_default": qk.Int8WeightOnlyConfig(),
                                          "re:.*experts.*": qk.Int4WeightOnlyConfig(group_size=32)}), strict=True)
    with pytest.raises(ValueError) as e:
        qk.save_compressed_tensors(model, tmp_path)
    text = str(e.value)
    assert "4 weight(s) have no exact compressed-tensors form, nothing was written" in text
    assert ("model.layers.0.mlp.experts.gate_up_proj (uint4, block_size (1, 1, 32), zero point float, "
            "TensorCoreTiledLayout(inner_k_tiles=4)) as model.layers.0.mlp.experts.0.gate_proj (rows [0, 32) of "
            "expert 0): its zero point is in the float domain") in text
    assert "(15 more of its 16 Linears likewise)" in text
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_gpt_oss_experts_are_refused(tmp_path):
    """transformers saves gpt-oss's experts fused (E, K, N): no per-expert Linears exist for them."""
    model = tiny_moe("gpt_oss")
    qk.quantize_(model, qk.Int8WeightOnlyConfig(), strict=True)
    with pytest.raises(ValueError, match=r"keeps model\.layers\.0\.mlp\.experts\.\w+ fused, as one 3-d tensor"):
        qk.save_compressed_tensors(model, tmp_path)


@pytest.mark.parametrize("case, message", [
    ("missing", r"model\.safetensors: tensor model\.layers\.1\.mlp\.experts\.6\.up_proj\.weight_scale is missing"),
    ("mixed", r"the Linears of model\.layers\.0\.mlp\.experts\.down_proj are partly quantized \(model\.layers\.0\."
              r"mlp\.experts\.2\.down_proj\.weight is float, 7 of 8 are not\)"),
    ("scale", r"expert 5 of model\.layers\.0\.mlp\.experts\.gate_up_proj \(model\.layers\.0\.mlp\.experts\.5\."
              r"gate_proj, model\.layers\.0\.mlp\.experts\.5\.up_proj\): scale has 1 NaN/Inf"),
])
def test_hostile_expert_linears_refused(tmp_path, case, message):
    model = _quantized("qwen3_moe", "int4_g16_asym")
    qk.save_compressed_tensors(model, tmp_path)
    t = load_file(tmp_path / "model.safetensors")
    if case == "missing":
        t.pop("model.layers.1.mlp.experts.6.up_proj.weight_scale")
    elif case == "mixed":  # one expert's down_proj stored float, outside every target
        prefix = "model.layers.0.mlp.experts.2.down_proj."
        for k in [k for k in t if k.startswith(prefix)]:
            t.pop(k)
        t[prefix + "weight"] = model.model.layers[0].mlp.experts.down_proj.dequantize()[2].contiguous()
        config = json.loads((tmp_path / "config.json").read_text())
        for group in config["quantization_config"]["config_groups"].values():
            group["targets"] = [g.replace(r"experts\.\d+\.down_proj", r"experts\.[013-7]\.down_proj")
                                for g in group["targets"]]
        (tmp_path / "config.json").write_text(json.dumps(config))
    else:
        t["model.layers.0.mlp.experts.5.up_proj.weight_scale"][3, 1] = float("inf")
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(qk.CheckpointError, match=message):
        qk.from_pretrained(tmp_path)


def test_transformers_loads_the_moe_exports_without_torchqkit(tmp_path):
    """transformers + compressed-tensors read the per-expert Linears back into its fused experts (decompressing them:
    its MoE path runs float experts) under the names it saves: logits equal up to float32 summation order (float32
    F.linear on the decompressed weights against torchqkit's kernels; measured <= 2.4e-7 on logits of magnitude
    ~0.5). Not asymmetric int4 (transformers 5.24 decompresses MoE experts without their zero points), int8 with
    int8 activations (its MoE path decompresses packed and float8 experts only) or MXFP4 / NVFP4 (bfloat16 only)."""
    pytest.importorskip("compressed_tensors")
    keys = ("int4_g16_sym", "int8_weight_only", "fp8_weight_only")
    models = {(name, key): _quantized(name, key) for name in SAVED for key in keys}
    dirs = {k: tmp_path / f"{k[0]}_{k[1]}" for k in models}
    for k, model in models.items():
        qk.save_compressed_tensors(model, dirs[k])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TORCHQKIT_NO_STARTUP_HOOK="1")
    subprocess.run([sys.executable, "-c", _HF_LOAD, str(IDS.tolist()), *(str(d) for d in dirs.values())],
                   check=True, env=env, cwd=tmp_path, capture_output=True)
    for k, model in models.items():
        with torch.no_grad():
            ours = model(IDS).logits
        torch.testing.assert_close(torch.load(dirs[k] / "logits.pt"), ours, atol=1e-5, rtol=0, msg=str(k))
