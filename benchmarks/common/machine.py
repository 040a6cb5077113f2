"""The machine a run measured: CPU model, cores, cache, ISA levels, library versions and the source's commit.

Every record carries this description (records.py), so a figure is never separated from where it was taken."""
from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

import torchqkit

REPO = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def l3_bytes() -> int:
    """The last-level cache this CPU reports (sysfs), or 32 MiB when it doesn't say. A VM may report the host's
    whole L3, of which it holds less: the ring built on it (memory.py) is 3x this, on the safe side."""
    try:
        size = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return 32 * 2**20
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
    return int(size.rstrip("KMG")) * scale


def isa_level() -> str:
    """The ISA level torchqkit's C++ kernels run at (TORCHQKIT_CPU_ISA may lower it), or why there is none."""
    try:
        return torch.ops.torchqkit_cpu.isa()
    except (AttributeError, RuntimeError):
        return "none (C++ CPU kernels not loaded)"


def kernel_path() -> str:
    """What torchqkit.kernels says serves its CPU linears ("cpp avx512_bf16", "reference" when nothing is built)."""
    from torchqkit import kernels
    try:
        return kernels.cpu_backend("torchqkit::linear_int8wo_plain")[0]
    except (AttributeError, RuntimeError):
        return "reference"


@lru_cache(maxsize=1)
def git_commit() -> str:
    """HEAD of the checkout these benchmarks run from, '+dirty' with uncommitted changes; 'unknown' outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


@lru_cache(maxsize=1)
def _fixed() -> dict:
    """What can't change within a process (the ISA level is chosen when the extension loads)."""
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "l3_bytes": l3_bytes(),
        "isa": isa_level(),
        "cpu_kernels": kernel_path(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def describe() -> dict:
    """The machine fields of a record (threads as torch has them set at the time of the call)."""
    return {**_fixed(), "threads": torch.get_num_threads()}


def versions() -> dict:
    return {"torchqkit_version": torchqkit.__version__, "torch_version": torch.__version__, "git_commit": git_commit()}
