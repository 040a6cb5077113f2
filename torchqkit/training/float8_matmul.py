"""Scaled float8 matmul for training: cast both operands to float8 with the oracle, multiply, rescale.

``a`` (M, K) is scaled per tensor or per row (one scale per M), ``b`` (K, N) per tensor or per column (one per
N): the scale always runs along a dimension the product keeps, which is what ``torch._scaled_mm`` accepts
(scale_a (M, 1) or (1, 1), scale_b (1, N) or (1, 1)). On a CUDA device of compute capability 8.9 or more the
product is ``torch._scaled_mm``; elsewhere it is emulated: the float8 values times their scales, multiplied
in float32. Both see the same float8 codes; they differ only in the order of the float32 accumulation.
"""
from __future__ import annotations

import torch

from ..core.primitives import choose_qparams_affine, quantize_affine
from ..core.qdtype import QDType
from ..kernels import aten_scaled_mm

__all__ = ["Float8Operand", "cast_to_float8", "record_saturation", "scaled_mm", "scaled_mm_on_tensor_cores",
           "matmul_backend"]

EMULATED = "emulated"
SCALED_MM = "torch._scaled_mm"


class Float8Operand:
    """float8 codes and their float32 scale (x ~ codes * scale), of a (rows, cols) matrix."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        self.codes, self.scale = codes, scale

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale


def cast_to_float8(t: torch.Tensor, qdtype: QDType, block_size, scale: torch.Tensor | None = None) -> Float8Operand:
    """``t`` in ``qdtype`` with one scale per block (absmax / max of the format), or with the given ``scale``
    (delayed scaling: values beyond the format's range saturate at its max)."""
    if scale is None:
        scale, _ = choose_qparams_affine(t, qdtype, block_size, scale_dtype=torch.float32, check_finite=False,
                                         name="float8 training operand")
    codes = quantize_affine(t, qdtype, block_size, scale, check_finite=False, name="float8 training operand")
    return Float8Operand(codes, scale)


def record_saturation(overflow: torch.Tensor, row: int, t: torch.Tensor, qdtype: QDType, scale: torch.Tensor) -> None:
    """Adds to ``overflow[row]`` = (casts that saturated, elements that saturated, largest amax / range) what casting
    ``t`` with the fixed per-tensor ``scale`` saturates: the elements whose ``|t / scale|`` passes the format's max,
    the comparison ``quantize_affine``'s clamp makes (Note [Static float8 training scales])."""
    with torch.no_grad():
        fmax = qdtype.max_abs_level
        ratio = (t.detach().float() / scale.reshape(())).abs()
        peak = ratio.amax() / fmax  # NaN / Inf propagate into the peak
        overflow[row, 0] += (peak > 1).to(overflow.dtype)
        overflow[row, 1] += (ratio > fmax).sum().to(overflow.dtype)
        overflow[row, 2] = torch.maximum(overflow[row, 2], peak.to(overflow.dtype))


def matmul_backend(device: torch.device) -> tuple[str, str]:
    """(backend, why) for a float8 training matmul on ``device``."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9):
        return SCALED_MM, "float8 tensor cores (compute capability >= 8.9)"
    if device.type == "cuda":
        return EMULATED, "this GPU has no float8 tensor cores (compute capability < 8.9)"
    return EMULATED, (f"{device.type} has no fast float8 matmul (torch._scaled_mm on CPU is a slow reference); "
                      f"float8 casts are exact, the product of the dequantized float8 values runs in float32")


def scaled_mm(a: Float8Operand, b: Float8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """(a.codes * a.scale) @ (b.codes * b.scale) in ``out_dtype``, accumulated in float32."""
    if matmul_backend(a.codes.device)[0] == SCALED_MM:
        return scaled_mm_on_tensor_cores(a, b, out_dtype)
    return aten_scaled_mm.unaliased_cast(a.dequantize() @ b.dequantize(), out_dtype)


def scaled_mm_on_tensor_cores(a: Float8Operand, b: Float8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` in the forms its GPU kernels take (Note [torch._scaled_mm's contract] in
    kernels/aten_scaled_mm.py): the weight gradient's inner dim is the token count, any number."""
    return aten_scaled_mm.scaled_mm(a.codes, a.scale, b.codes, b.scale, out_dtype, gpu_forms=True)
