"""quantize_checkpoint without model= never quantizes what it can't tell is a Linear, and says so: GPT-2's
Conv1D weights, stored (in, out), by name or by their bias; T5's `shared` embedding and any tensor holding an
embedding's data (a tied head); ModuleConfigs patterns that select nothing. The CLI fails (non-zero, one line)
when nothing was quantized, and for a missing / already quantized source or an unusable destination."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import torchqkit as qk
from torchqkit.cli import main as cli_main

from .models import temporaries

REPO = Path(__file__).resolve().parents[2]


def _gpt2_like(path: Path) -> Path:
    """Names and shapes of a 1-layer GPT-2 (Conv1D weights are (in, out)), d = 64."""
    g = torch.Generator().manual_seed(0)
    t = {"wte.weight": torch.randn(100, 64, generator=g), "wpe.weight": torch.randn(32, 64, generator=g),
         "h.0.attn.c_attn.weight": torch.randn(64, 192, generator=g), "h.0.attn.c_attn.bias": torch.zeros(192),
         "h.0.attn.c_proj.weight": torch.randn(64, 64, generator=g), "h.0.attn.c_proj.bias": torch.zeros(64),
         "h.0.mlp.c_fc.weight": torch.randn(64, 256, generator=g), "h.0.mlp.c_fc.bias": torch.zeros(256),
         "h.0.mlp.c_proj.weight": torch.randn(256, 64, generator=g), "h.0.mlp.c_proj.bias": torch.zeros(64),
         "ln_f.weight": torch.ones(64), "ln_f.bias": torch.zeros(64)}
    safetensors.torch.save_file(t, path)
    return path


def test_gpt2_conv1d_weights_are_reported_not_quantized(tmp_path):
    src = _gpt2_like(tmp_path / "gpt2.safetensors")
    report = qk.quantize_checkpoint(src, tmp_path / "q.safetensors", qk.Int8WeightOnlyConfig(), progress=False)
    assert not report.quantized
    for fqn in ("h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"):
        assert report[fqn].status == "skipped" and "Conv1D" in report[fqn].reason and "model=" in report[fqn].reason
    assert report["wte"].status == "kept" and "embedding" in report["wte"].reason
    with pytest.raises(qk.QuantizationError, match="c_attn"):
        qk.quantize_checkpoint(src, tmp_path / "strict.safetensors", qk.Int8WeightOnlyConfig(), strict=True,
                               progress=False)
    assert not (tmp_path / "strict.safetensors").exists()
    with pytest.raises(qk.QuantizationError, match="no weight was quantized"):
        qk.quantize_checkpoint(src, tmp_path / "none.safetensors", qk.Int8WeightOnlyConfig(), progress=False,
                               require_quantized=True)
    assert not (tmp_path / "none.safetensors").exists() and not temporaries(tmp_path)


def test_a_bias_of_dim_one_size_marks_a_transposed_weight_whatever_its_name(tmp_path):
    g = torch.Generator().manual_seed(0)
    safetensors.torch.save_file({"blk.proj.weight": torch.randn(64, 96, generator=g), "blk.proj.bias": torch.zeros(96),
                                 "blk.out.weight": torch.randn(32, 64, generator=g), "blk.out.bias": torch.zeros(32)},
                                tmp_path / "f.safetensors")
    report = qk.quantize_checkpoint(tmp_path / "f.safetensors", tmp_path / "q.safetensors",
                                    qk.Int8WeightOnlyConfig(), progress=False)
    assert report["blk.proj"].status == "skipped" and "bias has 96 elements" in report["blk.proj"].reason
    assert report["blk.out"].status == "quantized"


def test_t5_shared_embedding_and_tied_head_stay_float(tmp_path):
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(100, 64, generator=g)
    safetensors.torch.save_file({"shared.weight": shared, "encoder.embed_tokens.weight": shared.clone(),
                                 "lm_head.weight": shared.clone(),  # tied in the model, saved twice
                                 "encoder.block.0.layer.0.SelfAttention.q.weight": torch.randn(64, 64, generator=g)},
                                tmp_path / "t5.safetensors")
    report = qk.quantize_checkpoint(tmp_path / "t5.safetensors", tmp_path / "q.safetensors",
                                    qk.Int8WeightOnlyConfig(), progress=False)
    assert [e.fqn for e in report.quantized] == ["encoder.block.0.layer.0.SelfAttention.q"]
    assert report["shared"].status == "kept" and "embedding" in report["shared"].reason
    assert report["lm_head"].status == "kept" and "same data as the embedding" in report["lm_head"].reason
    stored = safetensors.torch.load_file(tmp_path / "q.safetensors")
    assert torch.equal(stored["lm_head.weight"], shared) and torch.equal(stored["shared.weight"], shared)


def test_model_skeleton_decides_and_non_linears_are_reported(tmp_path):
    src = _gpt2_like(tmp_path / "gpt2.safetensors")
    skeleton = torch.nn.Module()
    skeleton.h = torch.nn.ModuleList([torch.nn.Module()])
    skeleton.h[0].mlp = torch.nn.Module()
    skeleton.h[0].mlp.c_proj = torch.nn.Linear(64, 256)  # the skeleton says this one is a Linear (as stored)
    report = qk.quantize_checkpoint(src, tmp_path / "q.safetensors", qk.Int8WeightOnlyConfig(), model=skeleton,
                                    progress=False)
    assert [e.fqn for e in report.quantized] == ["h.0.mlp.c_proj"]
    assert report["h.0.attn.c_attn"].status == "kept" and "not an nn.Linear" in report["h.0.attn.c_attn"].reason
    skeleton.h[0].mlp.gate = torch.nn.Linear(64, 64)  # a Linear the checkpoint lacks: reported, not ignored
    report = qk.quantize_checkpoint(src, tmp_path / "q.safetensors", qk.Int8WeightOnlyConfig(), model=skeleton,
                                    progress=False)
    assert report["h.0.mlp.gate"].status == "skipped" and "no h.0.mlp.gate.weight" in report["h.0.mlp.gate"].reason


def test_patterns_that_select_nothing_are_reported(tmp_path):
    g = torch.Generator().manual_seed(0)
    safetensors.torch.save_file({"layers.0.q_proj.weight": torch.randn(64, 64, generator=g)},
                                tmp_path / "f.safetensors")
    configs = qk.ModuleConfigs({r"re:layers\.\d+\.q_proj": qk.Int8WeightOnlyConfig(),
                                r"re:layers\.\d+\.qproj": qk.Int4WeightOnlyConfig(),  # typo: matches nothing
                                r"re:layers\.0\..*": qk.Int4WeightOnlyConfig()})  # shadowed by the first
    report = qk.quantize_checkpoint(tmp_path / "f.safetensors", tmp_path / "q.safetensors", configs, progress=False)
    assert report["layers.0.q_proj"].status == "quantized"
    assert report[r"re:layers\.\d+\.qproj"].status == "skipped" and report[r"re:layers\.0\..*"].status == "skipped"
    assert configs.unmatched(["layers.0.q_proj", "layers.0.k_proj"]) == [r"re:layers\.\d+\.qproj"]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchqkit", "quantize", *map(str, args), "--quiet"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def _one_line_error(proc, code: int, match: str):
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and match in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("python -m torchqkit quantize: error:")


def test_cli_refuses_clearly(tmp_path, capsys):
    src = _gpt2_like(tmp_path / "gpt2.safetensors")
    assert cli_main(["quantize", str(src), str(tmp_path / "q.safetensors"), "--config", "int8-wo", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "no weight was quantized" in err and "Conv1D" in err and not (tmp_path / "q.safetensors").exists()
    _one_line_error(_cli(tmp_path / "missing.safetensors", tmp_path / "q.safetensors", "--config", "int8-wo"), 2,
                    "no such checkpoint")
    float_file = tmp_path / "float.safetensors"
    safetensors.torch.save_file({"a.weight": torch.randn(64, 64)}, float_file)
    assert cli_main(["quantize", str(float_file), str(tmp_path / "q.safetensors"), "--config", "int8-wo",
                     "--quiet"]) == 0
    _one_line_error(_cli(tmp_path / "q.safetensors", tmp_path / "qq.safetensors", "--config", "int8-wo"), 2,
                    "already quantized")
    _one_line_error(_cli(float_file, float_file / "q.safetensors", "--config", "int8-wo"), 2, "float.safetensors")
    (tmp_path / "adir").mkdir()
    _one_line_error(_cli(float_file, tmp_path / "adir", "--config", "int8-wo"), 2, "is a directory")
