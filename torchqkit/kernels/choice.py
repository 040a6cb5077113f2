"""Backend choice: which implementation serves an op on a device, following a KernelPreference. This is the only
place that decides; layouts call ``linear_op(...)``.

Note [Backend choice]
~~~~~~~~~~~~~~~~~~~~~
Backends of a torchqkit op, by the key that finds them:
  "cuda"      C++ CUDA kernel (csrc/cuda, torchqkit._C_cuda) registered for the CUDA dispatch key
  "cpu"       C++ CPU kernel (csrc/cpu, torchqkit._C_cpu) registered for the CPU dispatch key
  "triton"    torchqkit_triton::<op> (kernels/triton/): on a GPU, or on CPU under TRITON_INTERPRET=1; a second
              namespace only so TRITON can name it: Note [Why a torchqkit_triton namespace] in kernels/triton
  "reference" the pure-PyTorch twin (reference.py), any device
KernelPreference.AUTO takes the first available of _AUTO_ORDER[device type]; the interpreter is never
chosen by AUTO (it is a test vehicle, orders of magnitude slower than the reference). TRITON, CUDA and
REFERENCE name one backend: if it can't serve the op on that device, linear_op raises, saying why.
"""
from __future__ import annotations

import torch

from . import loading
from .preference import KernelPreference
from .registry import op_def

__all__ = ["choose_backend", "linear_op"]

_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}
_PREFERRED = {KernelPreference.CUDA: "cuda", KernelPreference.TRITON: "triton", KernelPreference.REFERENCE: "reference"}


def _why_not(backend: str, op: str, device: str) -> str | None:
    """None if ``backend`` can serve ``op`` on ``device`` (a device type), else the reason it can't."""
    if backend == "reference":
        return None
    if backend == "triton":
        module, why = loading.triton_backend()
        if module is None:
            return why
        if op not in module.TRITON_OPS:
            return f"no Triton kernel for {op} (Triton has {sorted(module.TRITON_OPS)})"
        if device != "cuda" and not (device == "cpu" and module.INTERPRET):
            return f"Triton runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device}"
        return None
    if backend != device:
        return f"the C++ {backend} kernels don't run on {device} tensors"
    loaded, why = ((loading.CUDA_EXTENSION_LOADED, loading.CUDA_EXTENSION_REASON) if device == "cuda"
                   else (loading.CPU_EXTENSION_LOADED, loading.CPU_EXTENSION_REASON))
    if not loaded:
        return why
    if device == "cuda" and op not in loading.CUDA_OPS:
        return f"csrc/cuda has no kernel for {op}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op, device.upper()):
        return f"the C++ {device} extension has no kernel for {op}"
    return None


def usable_backends(op: str, device: str) -> list[str]:
    """Every backend that can serve ``op`` on ``device`` (a device type), fastest first as AUTO would try them."""
    return [b for b in ("cuda", "cpu", "triton", "reference") if _why_not(b, op, device) is None]


def choose_backend(op: str, device: str | torch.device, preference=KernelPreference.AUTO) -> tuple[str, str]:
    """(backend, why) for ``op`` on ``device`` under ``preference``; raises when a named backend can't serve."""
    op_def(op)  # unknown ops raise, naming the known ones
    dev = torch.device(device).type
    preference = KernelPreference(preference)
    if preference is not KernelPreference.AUTO:
        backend = _PREFERRED[preference]
        reason = _why_not(backend, op, dev)
        if reason is not None:
            raise RuntimeError(f"{op} on {dev}: KernelPreference.{preference.name} asks for the {backend} backend, "
                               f"but {reason}. Use KernelPreference.AUTO (status() shows what it picks) or REFERENCE.")
        return backend, f"KernelPreference.{preference.name}"
    skipped = []
    for backend in _AUTO_ORDER.get(dev, ("reference",)):
        reason = _why_not(backend, op, dev)
        if reason is None:
            return backend, "fastest available" + (f" ({'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{backend}: {reason}")
    raise AssertionError("the reference always serves")  # invariant: "reference" ends every order


def linear_op(op: str, device, preference=KernelPreference.AUTO):
    """The callable that runs ``op`` (same arguments as its schema) on ``device`` under ``preference``."""
    backend, _ = choose_backend(op, device, preference)
    name = op.split("::")[1]
    if backend == "triton":
        return getattr(torch.ops.torchqkit_triton, name)
    if backend == "reference":
        return op_def(op).reference
    return getattr(torch.ops.torchqkit, name)  # the dispatch key picks the C++ kernel
