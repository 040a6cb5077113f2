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

__all__ = ["Float8Operand", "cast_to_float8", "scaled_mm", "scaled_mm_on_tensor_cores", "matmul_backend"]

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
    return (a.dequantize() @ b.dequantize()).to(out_dtype)


def _pad_to(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    pad_rows, pad_cols = -t.shape[0] % rows, -t.shape[1] % cols
    if not pad_rows and not pad_cols:
        return t
    if t.dtype.itemsize == 1:  # float8: torch has no pad kernel for it; zero codes are zero bytes
        return torch.nn.functional.pad(t.view(torch.uint8), (0, pad_cols, 0, pad_rows)).view(t.dtype)
    return torch.nn.functional.pad(t, (0, pad_cols, 0, pad_rows), value=value)


def scaled_mm_on_tensor_cores(a: Float8Operand, b: Float8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` within what cuBLASLt / CUTLASS accept (Note [float8 training on tensor cores])."""
    # Note [float8 training on tensor cores]
    # torch._scaled_mm wants both dims of b and the inner dim of a in multiples of 16 (the weight gradient's inner
    # dim is the token count, anything), b column-major, and takes row-wise scales only with two e4m3 operands and a
    # bfloat16 output. So: zero-pad every dim to 16 (zero codes add nothing; the output is sliced back); row-wise
    # bfloat16 products of two e4m3 operands use the row-wise kernel; everything else (e5m2 gradients, float32
    # outputs) multiplies the codes with unit scales into float32, which is exact per product as the row-wise kernel
    # is, and applies the scales to that float32 result.
    m, n = a.codes.shape[0], b.codes.shape[1]
    codes_a = _pad_to(a.codes, 16, 16)
    codes_b = _pad_to(b.codes, 16, 16).t().contiguous().t()
    per_tensor = a.scale.numel() == 1 and b.scale.numel() == 1
    e4m3 = a.codes.dtype == b.codes.dtype == torch.float8_e4m3fn
    if per_tensor:
        out = torch._scaled_mm(codes_a, codes_b, scale_a=a.scale.reshape(()), scale_b=b.scale.reshape(()),
                               out_dtype=out_dtype)
    elif e4m3 and out_dtype == torch.bfloat16:
        scale_a = _pad_to(a.scale.reshape(-1, 1).expand(m, 1), 16, 1, value=1.0).contiguous()
        scale_b = _pad_to(b.scale.reshape(1, -1).expand(1, n), 1, 16, value=1.0).contiguous()
        out = torch._scaled_mm(codes_a, codes_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    else:
        one = torch.ones((), dtype=torch.float32, device=a.codes.device)
        product = torch._scaled_mm(codes_a, codes_b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (product[:m, :n] * a.scale.reshape(-1, 1) * b.scale.reshape(1, -1)).to(out_dtype)
    return out[:m, :n]
