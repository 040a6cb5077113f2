"""``torch._scaled_mm`` within what its kernels accept, for every float8 x float8 product torchqkit makes (the
float8 dynamic / static activation layouts' aten route and float8 training).

Note [torch._scaled_mm's contract]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a GPU (cuBLASLt / CUTLASS) ``torch._scaled_mm(a, b)`` wants the inner dim and both dims of ``b`` in multiples
of 16 and ``b`` column-major, and takes row-wise scales ((M, 1) and (1, N)) only with two e4m3 operands and a
bfloat16 output; torch 2.11's CPU implementation takes per-tensor scales only. So:
- every dim is zero-padded to 16 (zero codes add nothing; the output is sliced back);
- per-tensor scales go to ``_scaled_mm`` as they are;
- row-wise scales with two e4m3 operands and a bfloat16 output use the row-wise kernel on a GPU;
- anything else (e5m2 operands, float32 / float16 outputs) multiplies the codes with unit scales into float32,
  which is exact per product as the scaled kernels are, and applies the scales to that float32 result.
Only the float32 accumulation order differs between these forms. On a CPU, torch's reference ``_scaled_mm`` takes
any shape, and from torch 2.13 row-wise scales: it is called as it is there, so CPU results are those of the
dequantize-then-matmul definition up to its float32 summation order (bit for bit on an Intel Xeon with AVX-512, a
few ulps apart on an AMD Zen 5; dynamic float8 activations amplify a last-bit difference: one layer's output
rounds the next layer's activations).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["scaled_mm", "unaliased_cast"]


def _pad_to(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    pad_rows, pad_cols = -t.shape[0] % rows, -t.shape[1] % cols
    if not pad_rows and not pad_cols:
        return t
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:  # float8: no pad kernel; zero codes are zero bytes
        return F.pad(t.view(torch.uint8), (0, pad_cols, 0, pad_rows)).view(t.dtype)
    return F.pad(t, (0, pad_cols, 0, pad_rows), value=value)


_CPU_ROW_WISE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def scaled_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, *, gpu_forms: bool | None = None) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) in ``out_dtype`` (Note [torch._scaled_mm's contract]).

    Args:
        a: (M, K) float8 codes.
        scale_a: float32 scale, one element or (M, 1).
        b: (K, N) float8 codes, any memory layout.
        scale_b: float32 scale, one element or (1, N).
        out_dtype: the result's dtype.
        gpu_forms: pad and split the call as a GPU needs it; default: when ``a`` is on a GPU (a test sets it to check
            those forms on CPU).
    """
    m, n = a.shape[0], b.shape[1]
    per_tensor = scale_a.numel() == 1 and scale_b.numel() == 1
    if not (a.is_cuda if gpu_forms is None else gpu_forms) and (per_tensor or _CPU_ROW_WISE):
        if per_tensor:
            scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
        return torch._scaled_mm(a, b, scale_a=scale_a.float(), scale_b=scale_b.float(), out_dtype=out_dtype)
    codes_a = _pad_to(a, 16, 16).contiguous()
    codes_b = _pad_to(b, 16, 16).t().contiguous().t()
    if per_tensor:
        out = torch._scaled_mm(codes_a, codes_b, scale_a=scale_a.reshape(()).float(),
                               scale_b=scale_b.reshape(()).float(), out_dtype=out_dtype)
        return _unpadded(out, m, n)
    scale_a = scale_a.float().reshape(-1, 1).expand(m, 1)
    scale_b = scale_b.float().reshape(1, -1).expand(1, n)
    if out_dtype == torch.bfloat16 and a.dtype == b.dtype == torch.float8_e4m3fn and (a.is_cuda or _CPU_ROW_WISE):
        out = torch._scaled_mm(codes_a, codes_b, scale_a=_pad_to(scale_a, 16, 1, 1.0).contiguous(),
                               scale_b=_pad_to(scale_b, 1, 16, 1.0).contiguous(), out_dtype=out_dtype)
        return _unpadded(out, m, n)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    product = torch._scaled_mm(codes_a, codes_b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return unaliased_cast(_unpadded(product, m, n) * scale_a * scale_b, out_dtype)


# No aliasing no-ops (a full slice, a .to() of the same dtype) on a result: under torch 2.11's torch.compile an
# autograd.Function whose forward returns an alias of its result loses its custom backward's weight gradient
# (float8 training's; measured all zeros, test/training/test_float8_training.py).
def _unpadded(out: torch.Tensor, m: int, n: int) -> torch.Tensor:
    return out if out.shape == (m, n) else out[:m, :n]


def unaliased_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is, never a no-op ``.to()`` (see above)."""
    return t if t.dtype == dtype else t.to(dtype)
