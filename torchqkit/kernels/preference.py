"""KernelPreference: which backend a quantized weight asks for (stored on the tensor, shown in its repr).

Defined here, below layouts/ and tensor/, because the backend chooser (``kernels.choose_backend``) reads it.
What each value means for a layout's linear: Note [Kernel preference] in layouts/routes.py.
"""
from __future__ import annotations

from enum import Enum

__all__ = ["KernelPreference"]


class KernelPreference(str, Enum):
    """Which implementation serves a quantized op; stored on the tensor, shown in its repr.

    Every config takes it as ``kernel_preference`` (a member or its string value). Anything but ``AUTO`` runs exactly
    that backend or raises a ``RuntimeError`` naming the weight, the op and why the backend can't run, never falling
    back. ``qk.kernels.status()`` says what ``AUTO`` picks on this machine.

    Attributes:
        AUTO: the fastest implementation present for the layout and device (the C++ kernels on a CPU); the reference
            where there is none, which ``status()`` says.
        REFERENCE: dequantize (and fake-quantize activations), then a float matmul: the oracle, on any device.
        TRITON: the Triton kernel (a GPU, or ``TRITON_INTERPRET=1`` set before import on a CPU).
        CUDA: the CUDA C++ kernel (``csrc/cuda``) for the op on a CUDA device.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Int4WeightOnlyConfig(kernel_preference=qk.KernelPreference.REFERENCE))
        qk.Int8WeightOnlyConfig(kernel_preference="auto")   # the string value works too
        ```
    """
    AUTO = "auto"            # the fastest path torchqkit has for this layout and device
    REFERENCE = "reference"  # dequantize (and fake-quantize activations), then a float matmul
    TRITON = "triton"        # the Triton kernel (a GPU, or TRITON_INTERPRET=1 on CPU); an error if there is none
    CUDA = "cuda"            # the CUDA C++ kernel (csrc/cuda); an error if there is none for the op / device
