"""``import torchqkit`` is silent on the torch it pins: no DeprecationWarning (or any warning) even with every
warning shown or turned into an error, in a fresh process; and the enums that configs and tensors carry stay
usable as constants under torch.compile without a warning from torchqkit."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit import kernels
from torchqkit.kernels import cpu_build

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(qk.__file__).resolve().parent


def _import(*flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if not kernels.CPU_EXTENSION_LOADED:  # a reference-only install warns on purpose (test_missing_kernels.py)
        env[cpu_build.SILENCE_ENV] = "1"
    return subprocess.run([sys.executable, *flags, "-c", "import torchqkit; print(torchqkit.__file__)"],
                          capture_output=True, text=True, cwd=REPO, env={**env, "PYTHONPATH": str(PACKAGE.parent)},
                          timeout=300)


@pytest.mark.parametrize("flags", [[], ["-W", "default"], ["-W", "error::DeprecationWarning"], ["-W", "error"],
                                   ["-X", "dev"]], ids=["plain", "default", "error-deprecation", "error", "dev-mode"])
def test_import_prints_nothing(flags):
    done = _import(*flags)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == PACKAGE / "__init__.py"
    assert done.stderr == ""


def test_enums_compile_as_constants_without_torchqkit_warnings():
    model = nn.Sequential(nn.Linear(64, 32)).eval()
    qk.quantize_(model, qk.Int8DynamicActivationInt8WeightConfig(kernel_preference=qk.KernelPreference.REFERENCE))
    x = torch.randn(2, 64)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), model(x))
    ours = [w for w in caught if str(PACKAGE) in str(w.filename)]
    assert not ours, [str(w.message) for w in ours]
