"""The public API is what `torchqkit.__all__` lists, grouped by purpose; dir() shows it, errors are *Error."""
from __future__ import annotations

import subprocess
import sys

import torchqkit as qk


def test_every_public_name_exists_and_dir_shows_it():
    assert len(qk.__all__) == len(set(qk.__all__))
    for name in qk.__all__:
        assert hasattr(qk, name), name
    shown = dir(qk)
    assert set(qk.__all__) <= set(shown)
    assert "TorchqkitConfig" in shown  # imported on first use, listed all the same


def test_internals_are_not_public():
    for name in ("hf_registration", "register_safe_globals"):
        assert name not in qk.__all__ and not hasattr(qk, name)


def test_exceptions_are_named_error_and_warnings_warning():
    for name in qk.__all__:
        obj = getattr(qk, name)
        if isinstance(obj, type) and issubclass(obj, Warning):
            assert name.endswith("Warning"), name
        elif isinstance(obj, type) and issubclass(obj, BaseException):
            assert name.endswith("Error"), name
    assert qk.UnsupportedWeight is qk.UnsupportedWeightError  # the earlier name still catches it


def test_torchqkit_config_is_lazy():
    code = "import sys, torchqkit; assert 'transformers' not in sys.modules; print(len(torchqkit.__all__))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
