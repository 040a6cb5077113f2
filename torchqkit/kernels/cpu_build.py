"""What the C++ CPU extension's build decided, written by setup.py and read by the loader (kernels/__init__.py).

Note [Missing CPU kernels]
setup.py builds ``torchqkit._C_cpu`` as an optional extension, so a compiler error (or a compiler killed for
memory on a busy machine) still installs a working package whose every op runs its pure-PyTorch reference, many
times slower. That must never pass silently: setup.py leaves a small JSON file, BUILD_RECORD, next to where the
extension goes, saying why it is absent; on a CPU the kernels are written for, ``import torchqkit`` then warns
once (KernelsMissingWarning) with the reason and the command that rebuilds them, and the CLI prints the same note.
No warning when the extension loaded, or when its absence was asked for: TORCHQKIT_BUILD_CPU=0 at build time
(recorded in BUILD_RECORD as deliberate) or now, TORCHQKIT_DISABLE_CPU_EXTENSION=1, or SILENCE_ENV=1 (run on the
references, knowingly).
This module imports nothing from torchqkit or torch: setup.py loads it by path, before torch may be importable.
"""
from __future__ import annotations

import json
import os
import platform

__all__ = ["BUILD_RECORD", "REBUILD", "SILENCE_ENV", "cpu_has_kernels", "write_record", "remove_record",
           "read_record", "build_error_summary"]

BUILD_RECORD = "_C_cpu.build.json"
SILENCE_ENV = "TORCHQKIT_NO_KERNELS_WARNING"
REBUILD = ("`pip install --no-build-isolation -e .` in the torchqkit source checkout (or `pip install "
           "--no-build-isolation --force-reinstall --no-deps torchqkit`); its build log says what failed")
# csrc/cpu is x86-64 code (immintrin.h, per-function target attributes): elsewhere setup.py doesn't build it.
_KERNEL_MACHINES = ("x86_64", "amd64", "x64")


def cpu_has_kernels(machine: str | None = None) -> bool:
    """Whether csrc/cpu has kernels for this CPU architecture (``platform.machine()`` by default)."""
    return (machine if machine is not None else platform.machine()).lower() in _KERNEL_MACHINES


def write_record(directory, *, deliberate: bool, reason: str) -> None:
    """Record in ``directory`` (the package folder the extension would be in) why it was not built."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, BUILD_RECORD), "w", encoding="utf-8") as f:
        json.dump({"deliberate": deliberate, "reason": reason}, f)
        f.write("\n")


def remove_record(directory) -> None:
    try:
        os.remove(os.path.join(directory, BUILD_RECORD))
    except FileNotFoundError:
        pass


def read_record(directory) -> dict | None:
    """{"deliberate": bool, "reason": str} from ``directory``, or None when there is none (or it is unreadable:
    then the extension's absence counts as not asked for)."""
    try:
        with open(os.path.join(directory, BUILD_RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(record, dict) and isinstance(record.get("deliberate"), bool)
            and isinstance(record.get("reason"), str)):
        return None
    return {"deliberate": record["deliberate"], "reason": record["reason"][:2000]}


def build_error_summary(error: BaseException, lines: int = 6, chars: int = 800) -> str:
    """The lines of a failed compile that say what went wrong: the first "error" / "killed" lines (the compiler's
    first error is the informative one), else the last lines."""
    text = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    errors = [line for line in text if "error" in line.lower() or "killed" in line.lower()]
    return " | ".join(errors[:lines] if errors else text[-lines:])[:chars]
