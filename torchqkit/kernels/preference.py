"""KernelPreference: which backend a quantized weight asks for (stored on the tensor, shown in its repr).

Defined here, below layouts/ and tensor/, because the backend chooser (``kernels.choose_backend``) reads it.
What each value means for a layout's linear: Note [Kernel preference] in layouts/routes.py.
"""
from __future__ import annotations

from enum import Enum

__all__ = ["KernelPreference"]


class KernelPreference(str, Enum):
    """Which implementation serves a quantized op; stored on the tensor, shown in its repr."""
    AUTO = "auto"            # the fastest path torchqkit has for this layout and device
    REFERENCE = "reference"  # dequantize (and fake-quantize activations), then a float matmul
    TRITON = "triton"        # the Triton kernel (a GPU, or TRITON_INTERPRET=1 on CPU); an error if there is none
    CUDA = "cuda"            # the CUDA C++ kernel (csrc/cuda); an error if there is none for the op / device
