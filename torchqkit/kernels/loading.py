"""Loading the backends that register kernels on the ``torchqkit::`` ops, once, when ``torchqkit.kernels`` is
imported: the C++ CPU extension ``torchqkit._C_cpu``, the C++ CUDA extension ``torchqkit._C_cuda`` and the
Triton kernels. Which ops each one serves is read from the dispatcher, never listed by hand.

The CPU extension loads if setup.py built it; ``TORCHQKIT_DISABLE_CPU_EXTENSION=1`` skips it (checks the
reference-only install). Where it should exist but doesn't load, importing warns once (KernelsMissingWarning, with
the reason and the rebuild command): see Note [Missing CPU kernels] in cpu_build.py.
The CUDA extension (csrc/cuda) loads where torch has CUDA and setup.py built it. The Triton kernels
(``kernels/triton``, ``torchqkit_triton::`` ops) are imported on first use, or at import on a machine with a GPU,
where each op without a C++ CUDA kernel gets its Triton kernel on the CUDA dispatch key.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os

import torch

from . import ops  # noqa: F401  (defines every op the backends register on)
from .cpu_build import read_record
from .missing import missing_kernels_note, warn_missing_kernels
from .registry import OPS

__all__ = ["CPU_EXTENSION_LOADED", "CPU_EXTENSION_REASON", "MISSING_KERNELS_NOTE", "CPU_OPS", "KERNEL_ACT_DTYPES",
           "CUDA_EXTENSION_LOADED", "CUDA_EXTENSION_REASON", "CUDA_OPS", "triton_backend",
           "register_triton_for_cuda_key"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_extension(module: str, what: str, not_built: str) -> tuple[bool, str]:
    """(loaded, why): load the compiled library ``module`` (its kernels register on the torchqkit ops). Only the
    one in this package's own folder: an import hook (an editable install elsewhere) must not lend another
    checkout's build, compiled from other sources."""
    spec = importlib.machinery.PathFinder.find_spec(module, [_PACKAGE_DIR])
    if spec is None or spec.origin is None:
        return False, f"the {what} {module} is not built ({not_built})"
    try:
        torch.ops.load_library(spec.origin)
    except OSError as e:  # e.g. built against another torch: undefined symbols
        return False, f"loading {spec.origin} failed: {e}"
    return True, f"{what} {os.path.basename(spec.origin)} loaded"


# setup.py's record of why it didn't build the CPU extension, next to where the extension goes (or None)
_CPU_BUILD_RECORD = read_record(_PACKAGE_DIR)


def _load_cpu_extension() -> tuple[bool, str]:
    if os.environ.get("TORCHQKIT_DISABLE_CPU_EXTENSION") == "1":
        return False, "TORCHQKIT_DISABLE_CPU_EXTENSION=1 skipped the C++ CPU extension"
    why = (f"setup.py: {_CPU_BUILD_RECORD['reason']}" if _CPU_BUILD_RECORD
           else "setup.py could not compile it, or the package was installed without it; see the pip build log")
    return _load_extension("torchqkit._C_cpu", "C++ CPU extension", why)


CPU_EXTENSION_LOADED, CPU_EXTENSION_REASON = _load_cpu_extension()
MISSING_KERNELS_NOTE = missing_kernels_note(CPU_EXTENSION_LOADED, CPU_EXTENSION_REASON, _CPU_BUILD_RECORD)
warn_missing_kernels(MISSING_KERNELS_NOTE)

KERNEL_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations the C++ kernels take
# Ops the C++ CPU extension registered a kernel for (status() lists them), read from the dispatcher.
CPU_OPS = tuple(op for op in OPS if CPU_EXTENSION_LOADED and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"))


def _load_cuda_extension() -> tuple[bool, str]:
    if torch.version.cuda is None:
        return False, "torch is a CPU build (torch.version.cuda is None): the CUDA extension can't exist"
    return _load_extension("torchqkit._C_cuda", "CUDA extension",
                           "setup.py builds it when torch has CUDA; see the pip build log")


CUDA_EXTENSION_LOADED, CUDA_EXTENSION_REASON = _load_cuda_extension()
# Ops csrc/cuda registered a kernel for, read from the dispatcher before any Triton kernel joins the CUDA key.
CUDA_OPS = tuple(op for op in OPS
                 if CUDA_EXTENSION_LOADED and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"))
_TRITON: list = []  # [module or None, reason], filled on first use (importing triton takes a while)


def triton_backend():
    """(torchqkit.kernels.triton or None, reason)."""
    if not _TRITON:
        if importlib.util.find_spec("triton") is None:
            _TRITON.extend([None, "triton is not installed (pip install triton)"])
        elif os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            _TRITON.extend([None, "no GPU, and TRITON_INTERPRET=1 was not set before import: Triton can't run"])
        else:
            from . import triton as module
            how = "interpreter (TRITON_INTERPRET=1)" if module.INTERPRET else f"GPU family {module.gpu_family()}"
            _TRITON.extend([module, f"Triton kernel, {how}"])
    return _TRITON[0], _TRITON[1]


def register_triton_for_cuda_key(module, lib: torch.library.Library) -> list[str]:
    """Give each torchqkit op that has a Triton kernel but no C++ CUDA kernel its Triton kernel as the CUDA
    dispatch key's implementation (in ``lib``), so ``torch.ops.torchqkit.<op>`` on CUDA tensors runs what
    KernelPreference.AUTO promises (Note [Backend choice] in choice.py: C++ CUDA, then Triton). Returns the ops it
    registered."""
    done = []
    for op, triton_name in module.TRITON_OPS.items():
        if op in CUDA_OPS and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"):
            continue  # the C++ CUDA kernel comes first
        lib.impl(op.split("::")[1], getattr(torch.ops.torchqkit_triton, triton_name.split("::")[1]), "CUDA")
        done.append(op)
    return done


_TRITON_LIB: list = []  # the torch.library.Library holding those registrations, while they live


def _register_triton_on_gpu() -> None:
    """On a machine with a GPU, import the Triton backend now and put it behind the CUDA key (see above)."""
    if not torch.cuda.is_available():
        return
    module, _ = triton_backend()
    if module is not None:
        _TRITON_LIB.append(torch.library.Library("torchqkit", "IMPL"))
        register_triton_for_cuda_key(module, _TRITON_LIB[0])


_register_triton_on_gpu()
