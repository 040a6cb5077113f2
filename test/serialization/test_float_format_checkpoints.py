"""NVFP4 and FP6 weights through every checkpoint path: safetensors (save_quantized / load_quantized, meta-device
model), transformers' save_pretrained / from_pretrained, and the header's refusal of a doctored tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import torchqkit as qk

CONFIGS = {"nvfp4": qk.NVFP4WeightOnlyConfig(), "nvfp4-dyn": qk.NVFP4DynamicActivationNVFP4WeightConfig(),
           "fp6-e3m2": qk.FP6WeightOnlyConfig(), "fp6-e2m3-g32": qk.FP6WeightOnlyConfig(ebits=2, group_size=32)}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 40, bias=False))  # K = 96, 64: whole blocks


def _x():
    return torch.randn(3, 96, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_safetensors_round_trip_into_a_meta_model(tmp_path, name):
    model = _model()
    qk.quantize_(model, CONFIGS[name])
    qk.save_quantized(model, tmp_path / "m.safetensors")
    with torch.device("meta"):
        skeleton = _model()
    loaded = qk.load_quantized(skeleton, tmp_path / "m.safetensors")
    for i in (0, 2):
        a, b = model[i].weight, loaded[i].weight
        assert b.attributes() == a.attributes()
        for t, u in zip(a.inner_tensors().values(), b.inner_tensors().values()):
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               u.view(torch.uint8) if u.element_size() == 1 else u)
    with torch.no_grad():
        assert torch.equal(loaded(_x()), model(_x()))


def test_nvfp4_checkpoint_with_a_wrong_global_scale_shape_is_refused(tmp_path):
    model = _model()
    qk.quantize_(model, qk.NVFP4WeightOnlyConfig())
    path = tmp_path / "m.safetensors"
    qk.save_quantized(model, path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        metadata = json.loads(f.read(n)).get("__metadata__")
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith(":global_scale"))
    tensors[key] = torch.ones(2)
    save_file(tensors, str(path), metadata=metadata)
    with torch.device("meta"):
        skeleton = _model()
    with pytest.raises(qk.CheckpointError, match="global_scale"):
        qk.load_quantized(skeleton, path)


@pytest.mark.parametrize("name", ["nvfp4", "fp6-e2m3-g32"])
def test_transformers_save_pretrained_from_pretrained(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    qk.quantize_(model, CONFIGS[name], filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    model.save_pretrained(tmp_path)
    loaded = qk.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 7, 30, 99, 5]])
    w = loaded.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, qk.AffineQuantizedTensor) and w.qlayout == model.model.layers[0].mlp.up_proj.weight.qlayout
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
