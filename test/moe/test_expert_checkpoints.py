"""Expert stacks in torchqkit safetensors checkpoints: save_quantized / load_quantized and save_pretrained /
from_pretrained give back the same stacks (logits bit for bit), and the loader checks each stored inner tensor
against the layout's per-expert packed shape with the expert dim in front."""
from __future__ import annotations

import json
import struct

import pytest
import torch

import torchqkit as qk

from .models import expert_stacks, tiny_moe, transformers

IDS = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("config", [qk.Int4WeightOnlyConfig(group_size=32), qk.NF4WeightOnlyConfig(double_quant=True),
                                    qk.Int8DynamicActivationInt8WeightConfig()], ids=["int4", "nf4_dq", "int8_dyn"])
def test_save_and_load_quantized_experts(config, tmp_path):
    model = tiny_moe("qwen3_moe")
    qk.quantize_(model, config)
    qk.save_quantized(model, tmp_path / "m.safetensors")
    back = transformers.Qwen3MoeForCausalLM(model.config).eval()
    qk.load_quantized(back, tmp_path / "m.safetensors")
    stacks, loaded = expert_stacks(model), expert_stacks(back)
    assert set(loaded) == set(stacks) and len(loaded) == 4
    for name, s in stacks.items():
        assert repr(loaded[name]) == repr(s) and torch.equal(loaded[name].dequantize(), s.dequantize())
    assert torch.equal(_logits(back), _logits(model))


def test_save_pretrained_and_from_pretrained(tmp_path):
    model = tiny_moe("olmoe")
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    qk.save_pretrained(model, tmp_path / "hf")
    back = qk.from_pretrained(tmp_path / "hf").eval()
    assert len(expert_stacks(back)) == 4 and torch.equal(_logits(back), _logits(model))


def test_a_header_whose_expert_shape_lies_is_refused(tmp_path):
    model = tiny_moe("mixtral")
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    path = tmp_path / "m.safetensors"
    qk.save_quantized(model, path)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    entries = json.loads(header["__metadata__"]["torchqkit"])
    entries["weights"]["model.layers.0.mlp.experts.down_proj"]["shape"][0] = 3  # 4 experts are stored
    header["__metadata__"]["torchqkit"] = json.dumps(entries)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    fresh = transformers.MixtralForCausalLM(model.config)
    with pytest.raises(qk.CheckpointError, match=r"model.layers.0.mlp.experts.down_proj.*qdata has shape \[4, 64, 32\]"):
        qk.load_quantized(fresh, path)


def test_transformers_from_pretrained_loads_and_quantizes_experts(tmp_path):
    """AutoModelForCausalLM.from_pretrained reads a torchqkit checkpoint's expert stacks (no float expert weights),
    and with quantization_config quantizes a float MoE checkpoint's experts (once loading is done) as quantize_ does;
    model.save_pretrained keeps each stack whole (transformers would split fused experts back per expert)."""
    model = tiny_moe("qwen3_moe")
    model.save_pretrained(tmp_path / "float")
    config = qk.Int4WeightOnlyConfig(group_size=32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=qk.TorchqkitConfig(config)).eval()
    report = qk.quantize_(model, config)
    assert [(e.fqn, e.status, e.bytes_after) for e in loaded.torchqkit_report.entries] == [
        (e.fqn, e.status, e.bytes_after) for e in report.entries]
    assert len(expert_stacks(loaded)) == 4 and torch.equal(_logits(loaded), _logits(model))
    loaded.save_pretrained(tmp_path / "int4")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "int4").eval()
    assert len(expert_stacks(back)) == 4 and torch.equal(_logits(back), _logits(model))
    model.save_pretrained(tmp_path / "adopted")  # quantize_ made torchqkit this model's quantizer
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adopted").eval()
    assert len(expert_stacks(back)) == 4 and torch.equal(_logits(back), _logits(model))
