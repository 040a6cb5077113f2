"""Progress lines on stderr: quantize_ and from_gguf draw one when asked (or on a terminal), never otherwise."""
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
    assert "quantize_: 3/3 layers (100%)" in err and err.endswith("\n")
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
    assert "from_gguf tiny.gguf: " in capsys.readouterr().err
