"""The devices a kernel or end-to-end test runs on, as one ``device`` fixture (test/conftest.py) instead of a CPU test
and a copy of it for the GPU.

- "cpu": CI and every development machine. Triton kernels run there under ``TRITON_INTERPRET=1`` (conftest.py sets
  it), the C++ CPU kernels natively.
- "cuda", marked ``gpu``: a machine with a CUDA GPU and Triton compiling natively. ``bash .ci/gpu_check.sh`` runs
  exactly these with ``TRITON_INTERPRET=0 pytest -m gpu``; everywhere else they skip and say why.
"""
from __future__ import annotations

import os

import pytest
import torch

GPU_MARK = "gpu: needs a CUDA GPU with Triton compiling natively; `bash .ci/gpu_check.sh` runs them (pytest -m gpu)"


def gpu_skip_reason() -> str | None:
    """Why the "cuda" cases can't run here, or None when they can."""
    if not torch.cuda.is_available():
        return (f"needs a CUDA GPU (torch {torch.__version__} sees none); `bash .ci/gpu_check.sh` runs these on a "
                f"GPU machine")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 would interpret the Triton kernels on the GPU: run `TRITON_INTERPRET=0 pytest -m gpu`"
    return None


def gpu_param(*values, id: str | None = None):  # noqa: A002  (pytest's own keyword)
    """One ``pytest.param`` marked ``gpu`` that skips, with the reason, where no GPU can run it."""
    reason = gpu_skip_reason()
    return pytest.param(*values, id=id, marks=[pytest.mark.gpu, pytest.mark.skipif(reason is not None,
                                                                                    reason=reason or "")])


DEVICES = [pytest.param("cpu", id="cpu"), gpu_param("cuda", id="cuda")]


def on_gpu(device: str) -> bool:
    return device == "cuda"
