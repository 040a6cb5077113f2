"""Quantizing never destroys its input: a destination that is the source file (by name, link or another path), or
whose save would replace or remove one of the source's shards, is refused before anything is read or written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import torchqkit as qk

from .models import listing


def _float_checkpoint(directory: Path, name="model.safetensors") -> Path:
    g = torch.Generator().manual_seed(0)
    path = directory / name
    safetensors.torch.save_file({"layer.weight": torch.randn(64, 64, generator=g), "layer.bias": torch.zeros(64)},
                                str(path))
    return path


def _destinations(tmp_path: Path, src: Path) -> dict[str, Path]:
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.safetensors").symlink_to(src)
    os.link(src, tmp_path / "hard.safetensors")
    return {"same name": src, "dot-dot": tmp_path / "sub" / ".." / src.name, "symlink": tmp_path / "link.safetensors",
            "hard link": tmp_path / "hard.safetensors"}


@pytest.mark.parametrize("how", ["same name", "dot-dot", "symlink", "hard link"])
def test_quantize_checkpoint_refuses_to_write_over_its_source(tmp_path, how):
    src = _float_checkpoint(tmp_path)
    dst = _destinations(tmp_path, src)[how]
    before = listing(tmp_path)
    with pytest.raises(ValueError, match="would destroy the float checkpoint") as err:
        qk.quantize_checkpoint(src, dst, qk.Int8WeightOnlyConfig(), progress=False)
    assert str(src) in str(err.value)
    assert listing(tmp_path) == before


def test_a_sharded_source_whose_shards_the_save_would_remove_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(64, 64, generator=g), "b.weight": torch.randn(64, 64, generator=g)}
    index = {"metadata": {"total_size": 2 * 64 * 64 * 4}, "weight_map": {}}
    for i, name in enumerate(tensors):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors.torch.save_file({name: tensors[name]}, str(tmp_path / shard))
        index["weight_map"][name] = shard
    import json
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    before = listing(tmp_path)
    with pytest.raises(ValueError, match="would write or remove"):
        qk.quantize_checkpoint(tmp_path / "model.safetensors.index.json", tmp_path / "model.safetensors",
                               qk.Int8WeightOnlyConfig(), progress=False)
    assert listing(tmp_path) == before
    out = qk.quantize_checkpoint(tmp_path / "model.safetensors.index.json", tmp_path / "int8.safetensors",
                                 qk.Int8WeightOnlyConfig(), progress=False)  # another name is fine
    assert len(out.quantized) == 2


@pytest.mark.parametrize("how", ["same name", "symlink", "hard link"])
def test_the_cli_exits_2_and_writes_nothing(tmp_path, how):
    src = _float_checkpoint(tmp_path)
    dst = _destinations(tmp_path, src)[how]
    before = listing(tmp_path)
    run = subprocess.run([sys.executable, "-m", "torchqkit", "quantize", str(src), str(dst), "--config", "int8-wo"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCHQKIT_NO_KERNELS_WARNING": "1"})
    assert run.returncode == 2, run.stderr
    assert "would destroy the float checkpoint" in run.stderr and "Traceback" not in run.stderr
    assert listing(tmp_path) == before


def test_the_eval_clis_text_file_through_a_link_is_refused(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("some words to score")
    (tmp_path / "link.txt").symlink_to(text)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    run = subprocess.run([sys.executable, "-m", "torchqkit", "eval", "--hf", str(tmp_path / "ckpt"), "--config", "int8-wo",
                          "--text", str(tmp_path / "link.txt")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCHQKIT_NO_KERNELS_WARNING": "1"})
    assert run.returncode == 2 and "symbolic link" in run.stderr, run.stderr
