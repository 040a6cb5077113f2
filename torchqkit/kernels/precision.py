"""torch's float32 matmul precision set for a block: the global switch that lets float32 activations take the bf16
kernels on AVX512-BF16 CPUs ("medium"; Note [fp32 activations in bf16] in csrc/cpu/fp32_matmul_precision.h)."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["float32_matmul_precision"]


@contextlib.contextmanager
def float32_matmul_precision(value: str):
    """torch.set_float32_matmul_precision(value) inside the block; the previous setting is restored after, also when
    the block raises."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
