"""Checkpoint files are opened only as themselves: a symbolic link (file, shard, index, quantize_checkpoint's
source) is refused, not followed; FIFOs and devices are refused without blocking; and no error message quotes
bytes of a file that isn't a checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

import torchqkit as qk

from .models import meta_mlp, mlp

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunter2-SECRET-4f9c"


def _secret_file(path: Path) -> Path:
    path.write_text(f"token={SECRET}\n" * 20)
    return path


def _error(fn) -> str:
    with pytest.raises(qk.CheckpointError) as err:
        fn()
    return str(err.value)


def test_symlinked_checkpoint_files_are_refused(tmp_path):
    secret = _secret_file(tmp_path / "credentials")
    link = tmp_path / "model.safetensors"
    link.symlink_to(secret)
    message = _error(lambda: qk.load_quantized(meta_mlp(), link))
    assert "symbolic link" in message and SECRET not in message and "token" not in message
    assert "symbolic link" in _error(lambda: qk.load_quantized(meta_mlp(), tmp_path))  # the directory form
    assert "symbolic link" in _error(lambda: qk.quantize_checkpoint(link, tmp_path / "q.safetensors",
                                                                    qk.Int8WeightOnlyConfig(), progress=False))
    # A real checkpoint behind a link is refused too: the link is the problem, not its target.
    real = tmp_path / "real"
    qk.save_quantized(mlp(0), real / "model.safetensors")
    link.unlink()
    link.symlink_to(real / "model.safetensors")
    assert "symbolic link" in _error(lambda: qk.load_quantized(meta_mlp(), link))


@pytest.mark.parametrize("which", ["index", "shard"])
def test_symlinked_index_or_shard_is_refused(tmp_path, which):
    path = tmp_path / "model.safetensors"
    summary = qk.save_quantized(mlp(0), path, max_shard_bytes=6000)
    target = summary.files[-1] if which == "index" else summary.files[0]
    moved = tmp_path / "elsewhere"
    target.rename(moved)
    target.symlink_to(moved)
    assert "symbolic link" in _error(lambda: qk.load_quantized(meta_mlp(), tmp_path))


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    code = ("import sys, torch, torchqkit as qk\n"
            "try:\n    qk.load_quantized(torch.nn.Linear(2, 2), sys.argv[1])\n"
            "except qk.CheckpointError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert "not a regular file" in proc.stdout, proc.stderr


def test_no_error_quotes_the_bytes_of_a_foreign_file(tmp_path):
    model = meta_mlp()
    _secret_file(tmp_path / "a.safetensors")  # text: its first 8 bytes are a huge "header length"
    # A "header" that is JSON but no safetensors header: values (and odd keys) are never quoted back.
    blob = json.dumps({"__metadata__": {"k": SECRET}, "x": SECRET, "0.weight": {"dtype": SECRET}}).encode()
    (tmp_path / "b.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob)
    bad_utf8 = b'{"x": "\xff' + SECRET.encode() + b'"}'
    (tmp_path / "c.safetensors").write_bytes(len(bad_utf8).to_bytes(8, "little") + bad_utf8)
    broken = b'{"x": ' + SECRET.encode() + b"}"
    (tmp_path / "d.safetensors").write_bytes(len(broken).to_bytes(8, "little") + broken)
    for name in "abcd":
        message = _error(lambda: qk.load_quantized(model, tmp_path / f"{name}.safetensors"))
        assert SECRET not in message and "token=" not in message and "\\xff" not in message, message
    index = tmp_path / "model.safetensors.index.json"
    for shard in (SECRET, f"../{SECRET}.safetensors"):
        index.write_text(json.dumps({"weight_map": {"0.weight": shard}}))
        assert SECRET not in _error(lambda: qk.load_quantized(model, index))


def test_torchqkit_header_values_are_not_quoted(tmp_path):
    path = tmp_path / "model.safetensors"
    qk.save_quantized(mlp(0), path)
    tensors = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, "pt") as f:
        meta = f.metadata()
    header = json.loads(meta["torchqkit"])
    edits = [lambda h: h["weights"]["0.weight"]["layout"].update(type=SECRET + " x"),
             lambda h: h["weights"]["0.weight"].update(qdtype=[SECRET]),
             lambda h: h["weights"]["0.weight"].update(act_quant={"static_scale": SECRET}),
             lambda h: h.update(format_version=SECRET),
             lambda h: h.update(format_version=9, torchqkit_version=SECRET + " x")]
    for edit in edits:
        broken = json.loads(json.dumps(header))
        edit(broken)
        safetensors.torch.save_file(tensors, path, metadata={**meta, "torchqkit": json.dumps(broken)})
        assert SECRET not in _error(lambda: qk.load_quantized(meta_mlp(), path))
