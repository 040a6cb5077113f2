"""transformers' model.save_pretrained after quantize_, however transformers loaded the model: from a GGUF file
(its GGUF quantizer said "not serializable") or in float (the quantized tensors were written as plain ones).
quantize_ makes torchqkit the model's quantizer; the checkpoint reloads with both loaders to the same logits."""
from __future__ import annotations

import json
import os

import pytest
import torch

import torchqkit as qk

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: before transformers
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from .tiny_gguf import VOCAB, write_tiny_llama  # noqa: E402

IDS = torch.arange(24).reshape(2, 12) * 7 % VOCAB
CONFIG = qk.Int4WeightOnlyConfig(group_size=32)


def _gguf_model(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)


def _float_model(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "float")
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float")


@pytest.mark.parametrize("load", [_gguf_model, _float_model], ids=["gguf", "float"])
@torch.no_grad()
def test_save_pretrained_after_quantize_reloads(tmp_path, load):
    model = load(tmp_path).eval()
    qk.quantize_(model, CONFIG)
    expected = model(IDS).logits
    model.save_pretrained(tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torchqkit" and qk.TorchqkitConfig.from_dict(qc).config == CONFIG
    assert "model.layers.1.mlp.down_proj" in qc["quantized"]
    for loader in (transformers.AutoModelForCausalLM.from_pretrained, qk.from_pretrained):
        loaded = loader(tmp_path / "out")
        assert isinstance(loaded.model.layers[1].mlp.down_proj.weight, qk.AffineQuantizedTensor)
        assert torch.equal(loaded(IDS).logits, expected), loader


@torch.no_grad()
def test_second_quantize_with_another_config_records_no_single_config(tmp_path):
    model = _float_model(tmp_path).eval()
    qk.quantize_(model, CONFIG, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and ".mlp." in fqn)
    assert model.config.quantization_config.config == CONFIG
    qk.quantize_(model, qk.Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: ".self_attn." in fqn)
    assert model.config.quantization_config.config is None  # each weight's format is in its header entry
    expected = model(IDS).logits
    model.save_pretrained(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded(IDS).logits, expected)
