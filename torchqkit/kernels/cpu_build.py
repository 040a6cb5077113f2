"""What the C++ CPU extension's build decided, written by setup.py and read by the loader (kernels/loading.py).

Note [Missing CPU kernels]
setup.py builds ``torchqkit._C_cpu`` as an optional extension, so a compiler error (or a compiler killed for
memory on a busy machine) still installs a working package whose every op runs its pure-PyTorch reference, many
times slower. That must never pass silently: setup.py leaves a small JSON file, BUILD_RECORD, next to where the
extension goes, saying why it is absent; on a CPU the kernels are written for, ``import torchqkit`` then warns
once (KernelsMissingWarning) with the reason and the command that rebuilds them, and the CLI prints the same note.
No warning when the extension loaded, or when its absence was asked for: TORCHQKIT_BUILD_CPU=0 at build time
(recorded in BUILD_RECORD as deliberate) or now, TORCHQKIT_DISABLE_CPU_EXTENSION=1, or SILENCE_ENV=1 (run on the
references, knowingly).

Note [Reusing a build]
A second `pip install --no-build-isolation -e .` (the README's test command after its demo command) would
compile every C++ file again: pip builds in a fresh folder each time, minutes on 2 cores. setup.py instead writes
BUILD_FINGERPRINT next to the library it built: a hash of every file under csrc/cpu and csrc/common, the compile
flags, torch's version and the Python ABI. When the library in the package folder carries the fingerprint of
what would be built now, the build copies it instead of compiling and says so; any change to a source, a flag or
torch rebuilds. TORCHQKIT_REBUILD_CPU=1 forces a build.
This module imports nothing from torchqkit or torch: setup.py loads it by path, before torch may be importable.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform

__all__ = ["BUILD_RECORD", "REBUILD", "SILENCE_ENV", "cpu_has_kernels", "write_record", "remove_record",
           "read_record", "build_error_summary", "BUILD_FINGERPRINT", "source_fingerprint", "reusable_build",
           "write_fingerprint"]

BUILD_RECORD = "_C_cpu.build.json"
BUILD_FINGERPRINT = "_C_cpu.fingerprint"
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


def source_fingerprint(source_dirs, settings: str) -> str:
    """A hash of every file under ``source_dirs`` (their relative names and bytes, in a fixed order) and
    ``settings`` (compile flags, torch version, Python ABI: whatever else decides the binary)."""
    digest = hashlib.sha256(settings.encode())
    for top in source_dirs:
        for folder, subfolders, files in sorted(os.walk(top)):
            subfolders.sort()
            for name in sorted(files):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, os.path.dirname(top)).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def _fingerprint_path(library: str) -> str:
    return os.path.join(os.path.dirname(library), BUILD_FINGERPRINT)


def reusable_build(library: str, fingerprint: str) -> bool:
    """Whether ``library`` (a built extension's path) exists and was built with ``fingerprint`` (Note [Reusing
    a build]); TORCHQKIT_REBUILD_CPU=1 says no."""
    if os.environ.get("TORCHQKIT_REBUILD_CPU") == "1" or not os.path.isfile(library):
        return False
    try:
        with open(_fingerprint_path(library), encoding="utf-8") as f:
            return f.read().strip() == fingerprint
    except OSError:
        return False


def write_fingerprint(library: str, fingerprint: str) -> None:
    with open(_fingerprint_path(library), "w", encoding="utf-8") as f:
        f.write(fingerprint + "\n")
