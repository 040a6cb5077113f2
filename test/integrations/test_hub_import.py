"""torchqkit.from_pretrained on GPTQ and AWQ checkpoints: the file's codes and scales in torchqkit layouts,
dequantizing bit for bit as AutoGPTQ / AutoAWQ do, and hostile checkpoints refused naming file and tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchqkit as qk
from torchqkit.integrations.hub_import import gather_permuted_input

from .hub_fixtures import awq_checkpoint, gptq_checkpoint, quantized_linears, reference_model

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 127, 0, 64]])
# Logits of a float16 LLaMA: the reference runs F.linear in float16 on the dequantized weights, torchqkit's kernels
# accumulate in float32; the logits (magnitude ~0.52) differed by at most 4.9e-4, one float16 ulp there (measured
# for every fixture here); two ulps allowed.
LOGITS_ATOL = 1e-3


def _dequantized(model, name):
    m = model.get_submodule(name)
    w = m.weight.dequantize()
    perm = getattr(m, "input_permutation", None)
    return w if perm is None else w[:, torch.argsort(perm)]


def _check_weights_and_logits(tmp_dir, model, ref, atol=LOGITS_ATOL):
    loaded = qk.from_pretrained(tmp_dir)
    for name, expected in ref.items():
        w = _dequantized(loaded, name)
        assert w.dtype == torch.float16
        assert torch.equal(w, expected), name  # bit for bit
    with torch.no_grad():
        want = reference_model(model, ref)(IDS).logits.float()
        got = loaded(IDS).logits.float()
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    return loaded


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_bit_exact_in_packed_intx(tmp_path, checkpoint_format):
    d, model, ref, _ = gptq_checkpoint(tmp_path, checkpoint_format=checkpoint_format)
    loaded = _check_weights_and_logits(d, model, ref)
    w = loaded.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w, qk.AffineQuantizedTensor) and isinstance(w.qlayout, qk.PackedIntxLayout)
    assert (w.qdtype.name, w.block_size) == ("uint4", (1, 32))
    entry = loaded.torchqkit_report["model.layers.0.self_attn.q_proj"]
    assert entry.status == "quantized" and entry.config.startswith("gptq uint4 g32")
    lm_head = loaded.lm_head.weight
    assert lm_head.dtype == torch.float16 and not isinstance(lm_head, qk.AffineQuantizedTensor)


@pytest.mark.parametrize("bits, layout", [(2, qk.PackedIntxLayout), (8, qk.PlainLayout)])
def test_gptq_2_and_8_bits(tmp_path, bits, layout):
    d, model, ref, _ = gptq_checkpoint(tmp_path, bits=bits)
    loaded = _check_weights_and_logits(d, model, ref)
    w = loaded.model.layers[1].mlp.down_proj.weight
    assert w.qdtype.name == f"uint{bits}" and isinstance(w.qlayout, layout)


def test_gptq_act_order_permutes_inputs_exactly(tmp_path):
    d, model, ref, linear = gptq_checkpoint(tmp_path, act_order=True)
    g_idx = linear["model.layers.0.mlp.down_proj"]["g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(128) // 32)  # really act-order
    loaded = _check_weights_and_logits(d, model, ref)
    m = loaded.model.layers[0].mlp.down_proj
    assert torch.equal(m.input_permutation, torch.argsort(g_idx.long(), stable=True))
    assert gather_permuted_input in [h for h in m._forward_pre_hooks.values()]
    assert "act-order" in loaded.torchqkit_report["model.layers.0.mlp.down_proj"].reason


def test_gptq_act_order_unequal_groups_dequantized_and_reported(tmp_path):
    d, model, ref, linear = gptq_checkpoint(tmp_path, act_order=True)
    tensors = load_file(d / "model.safetensors")
    g = tensors["model.layers.1.mlp.up_proj.g_idx"]
    g[g == 1] = 0  # group 0 gets 64 inputs, group 1 none: still in range, no permutation gives whole groups
    save_file(tensors, str(d / "model.safetensors"))
    loaded = qk.from_pretrained(d)
    m = loaded.model.layers[1].mlp.up_proj
    assert not isinstance(m.weight, qk.AffineQuantizedTensor)
    entry = loaded.torchqkit_report["model.layers.1.mlp.up_proj"]
    assert entry.status == "kept" and "unequal" in entry.reason
    t = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith("model.layers.1.mlp.up_proj.")}
    from .hub_fixtures import gptq_reference
    assert torch.equal(m.weight, gptq_reference(t))


def test_awq_bit_exact(tmp_path):
    d, model, ref, _ = awq_checkpoint(tmp_path)
    loaded = _check_weights_and_logits(d, model, ref)
    assert loaded.torchqkit_report["model.layers.1.mlp.gate_proj"].config.startswith("awq uint4 g32")


def _edit(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"))


@pytest.mark.parametrize("case, message", [
    ("qweight_shape", r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.qweight is torch\.int32 "
                      r"\(4, 32\); expected \(8, 32\)"),
    ("g_idx_range", r"model\.safetensors: tensor model\.layers\.0\.mlp\.up_proj\.g_idx: group indices must be in "
                    r"\[0, 2\)"),
    ("missing_scales", r"model\.safetensors: tensor model\.layers\.1\.self_attn\.o_proj\.scales is missing"),
    ("nan_scale", r"model\.safetensors: Linear model\.layers\.0\.mlp\.gate_proj .*scale has 1 NaN/Inf"),
    ("extra", r"tensor model\.layers\.0\.mlp\.gate_proj\.bogus belongs to no tensor"),
    ("bits_config", r"q_proj\.qweight is torch\.int32 \(8, 64\); expected \(16, 64\)"),
])
def test_hostile_gptq_refused_naming_file_and_tensor(tmp_path, case, message):
    d, *_ = gptq_checkpoint(tmp_path)
    if case == "qweight_shape":
        _edit(d, lambda t: t.update({"model.layers.0.self_attn.k_proj.qweight":
                                     t["model.layers.0.self_attn.k_proj.qweight"][:4].contiguous()}))
    elif case == "g_idx_range":
        def bad(t):
            t["model.layers.0.mlp.up_proj.g_idx"][5] = 2
        _edit(d, bad)
    elif case == "missing_scales":
        _edit(d, lambda t: t.pop("model.layers.1.self_attn.o_proj.scales"))
    elif case == "nan_scale":
        def bad(t):
            t["model.layers.0.mlp.gate_proj.scales"][0, 3] = float("nan")
        _edit(d, bad)
    elif case == "extra":
        _edit(d, lambda t: t.update({"model.layers.0.mlp.gate_proj.bogus": torch.zeros(2)}))
    elif case == "bits_config":  # config says 8-bit codes, the words hold 4-bit ones
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"]["bits"] = 8
        (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(qk.CheckpointError, match=message):
        qk.from_pretrained(d)


def test_awq_gemv_packing_refused(tmp_path):
    d, *_ = awq_checkpoint(tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(qk.CheckpointError, match=r"config\.json: quantization_config: version 'gemv' is not supported"):
        qk.from_pretrained(d)


def test_quantized_linears_of_the_fixture_are_all_imported(tmp_path):
    d, model, _, _ = awq_checkpoint(tmp_path)
    loaded = qk.from_pretrained(d)
    names = set(quantized_linears(model))
    assert {e.fqn for e in loaded.torchqkit_report.quantized} == names


def test_sharded_checkpoint_and_report(tmp_path):
    """Hub checkpoints come in shards with a model.safetensors.index.json; the index must agree with the shards."""
    d, model, ref, _ = gptq_checkpoint(tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(d / f))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = _check_weights_and_logits(d, model, ref)
    text = str(loaded.torchqkit_report)
    assert "model.layers.1.mlp.down_proj" in text and "gptq uint4 g32 -> uint4 block (1, 32)" in text
    moved = names[0]
    index["weight_map"][moved] = "model-00002-of-00002.safetensors"  # the index points at the wrong shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(qk.CheckpointError, match=rf"the index puts tensor {moved} in "
                                                  rf"model-00002-of-00002\.safetensors, which doesn't hold it"):
        qk.from_pretrained(d)
