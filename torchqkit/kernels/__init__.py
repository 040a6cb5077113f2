"""Which implementation serves each quantized op, and why.

Importing this package defines every ``torchqkit::`` custom op (``schemas.py``) with its pure-PyTorch
reference (``reference.py``), then loads the C++ CPU extension ``torchqkit._C_cpu`` if setup.py built it.
Without it every op still runs, on its reference, and ``status()`` says why.

The extension picks its ISA level at run time (AVX-512 VNNI, AVX2 + FMA, or scalar); the environment
variable ``TORCHQKIT_CPU_ISA=avx512_vnni|avx2|scalar`` forces a lower level (read on every call).
``TORCHQKIT_DISABLE_CPU_EXTENSION=1`` skips loading the extension (checks the reference-only install).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from . import reference, schemas

__all__ = ["status", "format_status", "cpu_backend", "CPU_EXTENSION_LOADED", "CPU_EXTENSION_REASON"]


def _load_cpu_extension() -> tuple[bool, str]:
    if os.environ.get("TORCHQKIT_DISABLE_CPU_EXTENSION") == "1":
        return False, "TORCHQKIT_DISABLE_CPU_EXTENSION=1 skipped the C++ CPU extension"
    spec = importlib.util.find_spec("torchqkit._C_cpu")
    if spec is None or spec.origin is None:
        return False, ("the C++ CPU extension torchqkit._C_cpu is not built (setup.py could not compile it; "
                       "see the pip build log, then `pip install --no-build-isolation -e .`)")
    try:
        torch.ops.load_library(spec.origin)
    except OSError as e:  # e.g. built against another torch: undefined symbols
        return False, f"loading {spec.origin} failed: {e}"
    return True, f"C++ CPU extension {os.path.basename(spec.origin)} loaded"


CPU_EXTENSION_LOADED, CPU_EXTENSION_REASON = _load_cpu_extension()

_CPU_KERNEL_NOTES = {
    "torchqkit::linear_int8wo_plain": {
        "avx512_vnni": "M < 16: streams each weight row once (dot kernel); M >= 16: fp32 panels + 6x32 FMA tiles",
        "avx2": "dot kernel (4 rows x 2 tokens, 8 lanes) for every M",
        "scalar": "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it",
    },
    "torchqkit::linear_int8da_int8_plain": {
        "avx512_vnni": "vpdpbusd (u8 = q + 128 times s8, corrected by row sums); M >= 8: packed panels, 6x32 tiles",
        "avx2": "exact int16 madd (vpmaddwd) dot kernel for every M",
        "scalar": "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it",
    },
}


def cpu_backend(op: str) -> tuple[str, str]:
    """(backend, reason) serving custom op ``op`` (e.g. "torchqkit::linear_int8wo_plain") on CPU."""
    if op not in schemas.OPS:
        raise ValueError(f"unknown op {op!r}; torchqkit ops: {list(schemas.OPS)}")
    if not CPU_EXTENSION_LOADED:
        return "reference", CPU_EXTENSION_REASON
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"):
        return "reference", "the C++ CPU extension has no kernel for this op"
    isa = torch.ops.torchqkit_cpu.isa()
    forced = os.environ.get("TORCHQKIT_CPU_ISA")
    why = f"forced by TORCHQKIT_CPU_ISA={forced}" if forced else "best level this CPU runs"
    return f"cpp {isa}", f"{why}; {_CPU_KERNEL_NOTES[op][isa]}"


def status() -> list[dict]:
    """One row per (layout, linear kind), then one per custom op: the path that serves it on CPU and why."""
    from ..layouts.base import all_layouts
    rows = []
    for layout in all_layouts():
        for row in getattr(layout, "linear_paths", lambda: [])():
            rows.append({"layout": layout.name, **row})
    for op in schemas.OPS:
        path, why = cpu_backend(op)
        rows.append({"layout": "(op)", "linear": op, "path": path, "why": why})
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
