"""Tiny models: one torch thread (see one_torch_thread in test/common.py)."""
from ..common import one_torch_thread  # noqa: F401  (an autouse fixture: every test here)
