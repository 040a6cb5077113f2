"""Progress lines on stderr: quantize_, calibration, load_quantized / from_pretrained, from_gguf,
quantize_checkpoint and the demo draw one when asked (or on a terminal), never otherwise."""
from __future__ import annotations

import io

import pytest
from torch import nn

import torchqkit as qk
from torchqkit.progress import progress_enabled


def _mlp(layers=3):
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])


def test_quantize_draws_a_line_when_asked_and_nothing_otherwise(capsys):
    qk.quantize_(_mlp(), qk.Int8WeightOnlyConfig(), progress=True)
    err = capsys.readouterr().err
    assert "quantize_ [####################] 3/3 layers (100%)" in err and err.endswith("\n")
    qk.quantize_(_mlp(), qk.Int8WeightOnlyConfig())          # default: stderr is captured, not a terminal
    qk.quantize_(_mlp(), qk.Int8WeightOnlyConfig(), progress=False)
    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_default_follows_the_terminal():
    assert progress_enabled(None, _Terminal()) and not progress_enabled(None, io.StringIO())
    assert progress_enabled(True, io.StringIO()) and not progress_enabled(False, _Terminal())


def test_from_gguf_draws_a_line_per_tensor(tmp_path, capsys):
    pytest.importorskip("gguf")
    from ..integrations.tiny_gguf import write_tiny_llama
    qk.from_gguf(write_tiny_llama(tmp_path / "tiny.gguf"), progress=True)
    assert "from_gguf tiny.gguf [####################] 20/20 tensors (100%)" in capsys.readouterr().err


def test_load_quantized_draws_a_line_per_tensor_when_asked(tmp_path, capsys):
    model = _mlp()
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    qk.save_quantized(model, tmp_path / "m.safetensors")
    qk.load_quantized(_mlp(), tmp_path / "m.safetensors", progress=True)
    assert "load_quantized m.safetensors [####################] 6/6 tensors (100%)" in capsys.readouterr().err
    qk.load_quantized(_mlp(), tmp_path / "m.safetensors")  # default: stderr is captured, not a terminal
    assert capsys.readouterr().err == ""


def test_from_pretrained_passes_progress_on(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    qk.save_pretrained(model, tmp_path / "m")
    capsys.readouterr()
    qk.from_pretrained(tmp_path / "m", progress=True)
    err = capsys.readouterr().err
    assert "load_quantized" in err and "tensors (100%)" in err
