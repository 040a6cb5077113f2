"""Every shard of a checkpoint names the save that wrote it, whoever cut the shards (Note [Shard headers],
serialization/save_load.py): shards of two saves of the same model, mixed, are refused by torchqkit's loaders and by
transformers' from_pretrained through the quantizer, instead of loading as a third model."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import torchqkit as qk

from .models import meta_mlp, mlp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
SHARD = 6000  # bytes: the test MLP makes 3 shards


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    """Two model.save_pretrained checkpoints of the same int8 model whose float tensors differ, cut in shards."""
    root = tmp_path_factory.mktemp("saves")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "float")
    for seed in (0, 1):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            root / "float", quantization_config=qk.TorchqkitConfig(qk.Int8WeightOnlyConfig()))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # the norms: same quantized weights, same headers, different models
                    p.add_(seed)
        model.save_pretrained(root / f"save{seed}", max_shard_size="20KB")
    return root


def _loaders():
    return {"qk.from_pretrained": qk.from_pretrained,
            "transformers": transformers.AutoModelForCausalLM.from_pretrained}


@pytest.mark.parametrize("loader", ["qk.from_pretrained", "transformers"])
def test_transformers_cut_shards_of_two_saves_are_refused(two_saves, tmp_path, loader):
    mixed = tmp_path / "mixed"
    shutil.copytree(two_saves / "save0", mixed)
    shards = sorted(p.name for p in mixed.glob("model-*.safetensors"))
    assert len(shards) > 1
    _loaders()[loader](two_saves / "save0")  # each save alone loads
    shutil.copy(two_saves / "save1" / shards[-1], mixed / shards[-1])
    with pytest.raises(qk.CheckpointError, match=f"{shards[-1]}: shard written by another save than {shards[0]}"):
        _loaders()[loader](mixed)


@pytest.mark.parametrize("loader", ["qk.from_pretrained", "transformers"])
def test_shards_without_a_save_id_are_refused(two_saves, tmp_path, loader):
    from safetensors import safe_open
    from safetensors.torch import save_file
    bare = tmp_path / "bare"
    shutil.copytree(two_saves / "save0", bare)
    for shard in bare.glob("model-*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        header = json.loads(meta["torchqkit"])
        del header["save_id"]
        save_file(tensors, shard, metadata={**meta, "torchqkit": json.dumps(header)})
    with pytest.raises(qk.CheckpointError, match="has no save id"):
        _loaders()[loader](bare)


def test_save_quantized_shards_of_two_saves_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    qk.save_quantized(mlp(0), a / "model.safetensors", max_shard_bytes=SHARD)
    qk.save_quantized(mlp(1), b / "model.safetensors", max_shard_bytes=SHARD)
    shards_a = sorted(p.name for p in a.glob("model-*.safetensors"))
    shards_b = sorted(p.name for p in b.glob("model-*.safetensors"))
    (a / shards_a[1]).write_bytes((b / shards_b[1]).read_bytes())  # one shard of b under a's name
    with pytest.raises(qk.CheckpointError, match="shard written by another save"):
        qk.load_quantized(meta_mlp(), a)


def test_each_save_pretrained_gets_its_own_save_id(two_saves):
    from safetensors import safe_open
    ids = set()
    for save in ("save0", "save1"):
        for shard in (two_saves / save).glob("model-*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                ids.add((save, json.loads(f.metadata()["torchqkit"])["save_id"]))
    assert len(ids) == 2 and {s for s, _ in ids} == {"save0", "save1"}
