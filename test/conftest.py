import os

import pytest

# Triton reads this when kernels are decorated: it must be set before any torchqkit.kernels.triton import.
# .ci/gpu_check.sh sets it to 0 so that the GPU tests compile the kernels natively.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiled graphs must never come from a cache written by other code (see docs/platform.md).
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

from test.devices import DEVICES, GPU_MARK  # noqa: E402  (after the settings above: it imports torch)


def pytest_configure(config):
    config.addinivalue_line("markers", GPU_MARK)


@pytest.fixture(params=DEVICES)
def device(request):
    """"cpu", and "cuda" where a GPU can run the test (test/devices.py): a test takes it instead of having a GPU copy."""
    return request.param
