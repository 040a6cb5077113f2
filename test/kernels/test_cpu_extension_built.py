"""The C++ CPU kernels must really be there: setup.py builds them optionally (an install without a compiler
still works, on the references), and every kernel test skips without them. This test makes a failed build
loud instead of a suite of silent skips, unless the environment turned the extension off on purpose."""
from __future__ import annotations

import os

import pytest

from torchqkit import kernels


def test_cpu_extension_is_built_and_loaded():
    if os.environ.get("TORCHQKIT_BUILD_CPU") == "0" or os.environ.get("TORCHQKIT_DISABLE_CPU_EXTENSION") == "1":
        pytest.skip("the C++ CPU extension was turned off by TORCHQKIT_BUILD_CPU=0 / TORCHQKIT_DISABLE_CPU_EXTENSION=1")
    assert kernels.CPU_EXTENSION_LOADED, kernels.CPU_EXTENSION_REASON
