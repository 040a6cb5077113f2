"""Triton backends of the torchqkit ops, one file per kernel.

Each file defines a ``torchqkit_triton::<op>`` op with the same schema as the ``torchqkit::<op>`` it
implements (``kernels/ops/``); ``kernels/__init__.py`` decides when it serves a linear. On CUDA the ops
are ``torch.library.triton_op`` + ``wrap_triton`` (Inductor traces into the kernel); under
``TRITON_INTERPRET=1`` on CPU the same launcher is a plain custom op with a fake impl (PLATFORM.md: torch.compile
can't trace a triton_op there), so CPU tests run the very kernel source. Importing this package needs triton.
"""
from . import float8_rowwise, float8_weight_only, int4_tiled_gemm, int4_tiled_gemv, int8_weight_only, mx_weight_only, nf4_weight_only
from .registration import INTERPRET, TRITON_OPS, gpu_family

__all__ = ["INTERPRET", "TRITON_OPS", "gpu_family", "float8_rowwise", "float8_weight_only", "int4_tiled_gemm", "int4_tiled_gemv",
           "int8_weight_only", "mx_weight_only", "nf4_weight_only"]
