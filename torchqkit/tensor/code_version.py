"""A short hash of torchqkit's Python sources, so compiled graphs are never reused across code versions."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["code_version"]


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
