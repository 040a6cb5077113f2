"""Saves fail whole (see Note [Atomic saves], torchqkit/serialization/atomic.py): a save that dies part-way (disk
full, simulated by a writer that raises) leaves the previous checkpoint byte-for-byte as it was, loadable, with
no temporaries; a sharded save replaces the whole set or nothing, and the loader never mixes two saves."""
from __future__ import annotations

import errno
import json
import os

import pytest
import safetensors.torch
import torch

import torchqkit as qk
from torchqkit.serialization import atomic, safetensors_file

from .models import listing, meta_mlp, mlp, outputs, temporaries

SHARD = 6000  # bytes: the test MLP makes 3 shards


def _disk_full_after(monkeypatch, n_tensors: int):
    """Make SafetensorsWriter.add fail with ENOSPC from its (n_tensors + 1)-th call on."""
    real, calls = safetensors_file.SafetensorsWriter.add, {"n": 0}

    def add(self, name, tensor):
        calls["n"] += 1
        if calls["n"] > n_tensors:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, tensor)
    monkeypatch.setattr(safetensors_file.SafetensorsWriter, "add", add)


@pytest.mark.parametrize("max_shard_bytes", [None, SHARD], ids=["single", "sharded"])
@pytest.mark.parametrize("fail_after", [0, 3, 7])
def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, max_shard_bytes, fail_after):
    old = mlp(0)
    path = tmp_path / "model.safetensors"
    qk.save_quantized(old, path, max_shard_bytes=max_shard_bytes)
    before = listing(tmp_path)
    _disk_full_after(monkeypatch, fail_after)
    with pytest.raises(OSError, match="No space left"):
        qk.save_quantized(mlp(1), path, max_shard_bytes=max_shard_bytes)
    assert listing(tmp_path) == before and not temporaries(tmp_path)
    assert torch.equal(outputs(qk.load_quantized(meta_mlp(), path)), outputs(old))


def test_failure_while_assembling_a_file_or_renaming_the_index(tmp_path, monkeypatch):
    old = mlp(0)
    path = tmp_path / "model.safetensors"
    qk.save_quantized(old, path, max_shard_bytes=SHARD)
    before = listing(tmp_path)

    def short_copy(src, dst, length):  # the header is written, then the disk fills while copying the data
        dst.write(src.read(10))
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(safetensors_file.shutil, "copyfileobj", short_copy)
        with pytest.raises(OSError):
            qk.save_quantized(mlp(1), path, max_shard_bytes=SHARD)
    assert listing(tmp_path) == before

    real_replace = os.replace

    def replace(src, dst):  # every shard is in place; moving the index fails
        if str(dst).endswith(".index.json"):
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)
    with monkeypatch.context() as m:
        m.setattr(atomic.os, "replace", replace)
        with pytest.raises(OSError, match="I/O error"):
            qk.save_quantized(mlp(1), path, max_shard_bytes=SHARD)
    assert listing(tmp_path) == before  # the new shards, already renamed, were removed again
    assert torch.equal(outputs(qk.load_quantized(meta_mlp(), tmp_path)), outputs(old))


@pytest.mark.parametrize("first,second", [(None, SHARD), (SHARD, SHARD), (SHARD, None)],
                         ids=["single-then-sharded", "sharded-then-sharded", "sharded-then-single"])
def test_a_new_save_replaces_the_whole_previous_set(tmp_path, first, second):
    path = tmp_path / "model.safetensors"
    qk.save_quantized(mlp(0), path, max_shard_bytes=first)
    new = mlp(1)
    summary = qk.save_quantized(new, path, max_shard_bytes=second)
    assert sorted(p.name for p in summary.files) == sorted(listing(tmp_path))  # nothing of the old set is left
    for where in (path, tmp_path):
        assert torch.equal(outputs(qk.load_quantized(meta_mlp(), where)), outputs(new))


def test_shards_of_another_save_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    qk.save_quantized(mlp(0), a / "model.safetensors", max_shard_bytes=SHARD)
    qk.save_quantized(mlp(1), b / "model.safetensors", max_shard_bytes=SHARD)
    # Someone copies b's shards over a's, under a's names (same tensors, same shapes: only the save id differs).
    names_a = sorted(p.name for p in a.iterdir() if not p.name.endswith(".json"))
    names_b = sorted(p.name for p in b.iterdir() if not p.name.endswith(".json"))
    for na, nb in zip(names_a, names_b):
        (a / na).write_bytes((b / nb).read_bytes())
    with pytest.raises(qk.CheckpointError, match="written by another save than this index"):
        qk.load_quantized(meta_mlp(), a)


def test_a_file_next_to_an_index_is_ambiguous_not_guessed(tmp_path):
    path = tmp_path / "model.safetensors"
    qk.save_quantized(mlp(0), path, max_shard_bytes=SHARD)
    qk.save_quantized(mlp(1), tmp_path / "other.safetensors")
    (tmp_path / "other.safetensors").rename(path)  # a stale single file, as an interrupted clean-up leaves it
    for where in (path, tmp_path):
        with pytest.raises(qk.CheckpointError, match="both this file and model.safetensors.index.json exist"):
            qk.load_quantized(meta_mlp(), where)
    qk.load_quantized(meta_mlp(), tmp_path / "model.safetensors.index.json")  # named explicitly: no guess


def test_quantize_checkpoint_output_is_atomic(tmp_path, monkeypatch):
    src = tmp_path / "float.safetensors"
    torch.manual_seed(0)
    safetensors.torch.save_file({f"l{i}.weight": torch.randn(64, 64) for i in range(4)}, src)
    out = tmp_path / "out"
    qk.quantize_checkpoint(src, out / "q.safetensors", qk.Int8WeightOnlyConfig(), progress=False,
                           max_shard_bytes=5000)
    before = listing(out)
    _disk_full_after(monkeypatch, 5)
    with pytest.raises(OSError, match="No space left"):
        qk.quantize_checkpoint(src, out / "q.safetensors", qk.Int4WeightOnlyConfig(group_size=32), progress=False,
                               max_shard_bytes=5000)
    assert listing(out) == before and not temporaries(out)
    info = qk.serialization.read_checkpoint_info(out / "q.safetensors")
    assert info["config"] == qk.Int8WeightOnlyConfig()


def test_module_configs_to_json_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "quant.json"
    configs = qk.ModuleConfigs({"_default": qk.Int8WeightOnlyConfig()})
    configs.to_json(path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(atomic.os, "fsync", fail)
    with pytest.raises(OSError):
        qk.ModuleConfigs({"_default": None}).to_json(path)
    assert path.read_bytes() == before and not temporaries(tmp_path)
    assert qk.ModuleConfigs.from_json(path) == configs


def test_save_pretrained_weights_go_through_the_atomic_writer(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    qk.save_pretrained(model, tmp_path)
    weights = (tmp_path / "model.safetensors").read_bytes()
    _disk_full_after(monkeypatch, 4)
    with pytest.raises(OSError, match="No space left"):
        qk.save_pretrained(model, tmp_path, config=qk.Int8WeightOnlyConfig())
    assert (tmp_path / "model.safetensors").read_bytes() == weights and not temporaries(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config"] is None
