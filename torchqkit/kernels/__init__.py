"""Which implementation serves each quantized op, and why.

No fused kernels are registered yet (C++ CPU, CUDA and Triton backends come in issues #4 and #5):
``status()`` says so for every layout rather than letting a slow path pass unnoticed.
"""
from __future__ import annotations

__all__ = ["status", "format_status"]


def status() -> list[dict]:
    """One row per (layout, linear kind): the path that serves it on CPU and the reason."""
    from ..layouts.base import all_layouts
    rows = []
    for layout in all_layouts():
        for row in getattr(layout, "linear_paths", lambda: [])():
            rows.append({"layout": layout.name, **row})
    return rows


def format_status() -> str:
    rows = status()
    if not rows:
        return "no layouts registered"
    keys = ["layout", "linear", "path", "why"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)
