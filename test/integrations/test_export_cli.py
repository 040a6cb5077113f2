"""python -m torchqkit export SOURCE --compressed-tensors DIR (run in-process through cli.main)."""
from __future__ import annotations

import json

import torch

import torchqkit as qk
from torchqkit.cli import main

from .hub_fixtures import gptq_checkpoint, tiny_llama


def test_export_a_gptq_checkpoint_to_compressed_tensors(tmp_path, capsys):
    src, _, ref, _ = gptq_checkpoint(tmp_path / "gptq", checkpoint_format="gptq_v2")
    assert main(["export", str(src), "--compressed-tensors", str(tmp_path / "ct")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj.weight_zero_point  pack-quantized int4 group 32 asymmetric, exact" in out
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["format"] == "pack-quantized"
    loaded = qk.from_pretrained(tmp_path / "ct")
    for name, expected in ref.items():  # GPTQ's own dequantization survives both conversions bit for bit
        assert torch.equal(loaded.get_submodule(name).weight.dequantize(), expected), name


def test_export_refusals_exit_1_and_2(tmp_path, capsys):
    src, *_ = gptq_checkpoint(tmp_path / "gptq", act_order=True)
    assert main(["export", str(src), "--compressed-tensors", str(tmp_path / "ct")]) == 1
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.q_proj.weight (uint4, block_size (1, 32), zero point int" in err
    assert "act-order weight stored with permuted in_features" in err and not (tmp_path / "ct").exists()
    model = tiny_llama()
    model.save_pretrained(tmp_path / "float")  # no quantization_config: not something from_pretrained reads
    assert main(["export", str(tmp_path / "float"), "--compressed-tensors", str(tmp_path / "ct")]) == 2
    assert "has no torchqkit quantization_config" in capsys.readouterr().err
