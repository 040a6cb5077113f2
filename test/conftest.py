import os

# Triton reads this when kernels are decorated: it must be set before any torchqkit.kernels.triton import.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiled graphs must never come from a cache written by other code (see docs/platform.md).
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
