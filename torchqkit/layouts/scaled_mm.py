"""The float8 x float8 linear shared by every layout that stores float8 codes as torch float8 tensors
(PlainLayout, Float8Layout): float8 activations x float8 weights.

The weight's ``qdata`` must be the (N, K) float8 codes (rows and columns padded to whole blocks at most) and
``scale`` one float scale per block. On a CPU, AUTO runs ``torchqkit::linear_fp8wo`` on the activation quantized and
dequantized (any weight scales; torch's CPU ``_scaled_mm`` is a reference implementation, ~150x slower for one
token). Elsewhere, with per-tensor / per-row weight scales, AUTO runs ``torch._scaled_mm`` (cuBLASLt on a GPU) in
the forms its kernels take (kernels/aten_scaled_mm.py); KernelPreference.TRITON runs
``torchqkit::scaled_mm_fp8_rowwise``'s Triton kernel on the same codes, with both scales expanded to rows.
"""
from __future__ import annotations

import torch

from ..core.qdtype import QKind
from ..kernels import aten_scaled_mm
from ..kernels.preference import KernelPreference
from .base import crop_features, pad_features
from .routes import (GroupedRoute, Route, flatten_tokens, grouped_on_fake_quantized_input, in_dtype_of,
                     on_fake_quantized_input)

__all__ = ["SCALED_MM_ROUTES", "SCALED_MM_ROUTE", "FNUZ_ON_NVIDIA_ROUTE", "FLOAT8_ON_CPU_ROUTE", "scaled_mm_applies",
           "scaled_mm_linear", "fp8_weight_only_call", "fp8_weight_only_grouped_call"]


def fp8_weight_only_call(fn, w, x, bias):
    """``torchqkit::linear_fp8wo`` on w's codes and block scales. Rows padded to whole blocks (e.g. 128 x 128) run
    with a zero-padded bias and are cropped off."""
    rows, cols = w.qdata.shape
    bias = None if bias is None else pad_features(bias, rows)
    return crop_features(fn(pad_features(x, cols), w.qdata, w.scale, bias), w.logical_shape[0])


def fp8_weight_only_grouped_call(fn, tensors, w, x, offs):
    qdata = tensors["qdata"]  # rows padded to whole blocks: cropped off the output
    return crop_features(fn(pad_features(x, qdata.shape[2]), offs, qdata, tensors["scale"]), w.logical_shape[0])


def scaled_mm_applies(w, x=None) -> bool:
    """True when ``F.linear(x, w)`` can run on ``torch._scaled_mm``: float8 activation quantization and a
    float8 weight with one scale per tensor or per row (``_scaled_mm`` has no scales inside K)."""
    spec = w.act_quant
    if spec is None:
        return False
    per_row = w.block_size == (1, w.logical_shape[1])
    per_tensor = w.block_size == w.logical_shape
    return (spec.qdtype.kind is QKind.FLOAT8 and spec.group_size is None and w.qdtype.kind is QKind.FLOAT8
            and (per_row or per_tensor))


def _quantized_rows(w, x: torch.Tensor):
    """(float8 codes (M, K), scale_a, scale_b): per-row scales for both when either is per row, else scalars."""
    n = w.logical_shape[0]
    x2 = flatten_tokens(x)
    qa = w.act_quant.quantize(x2)
    scale_a, scale_b = qa.scale.to(torch.float32), w.scale.reshape(1, -1).to(torch.float32)
    if scale_a.numel() != 1 or scale_b.numel() != 1:  # row-wise: both as rows, as _scaled_mm takes them
        return qa.qdata, scale_a.expand(x2.shape[0], 1).contiguous(), scale_b.expand(1, n).contiguous()
    return qa.qdata, scale_a.reshape(()), scale_b.reshape(())


def scaled_mm_linear(w, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    qa, scale_a, scale_b = _quantized_rows(w, x)
    out = aten_scaled_mm.scaled_mm(qa, scale_a, w.qdata.t(), scale_b, x.dtype)
    out = out.reshape(*x.shape[:-1], w.logical_shape[0])
    return out if bias is None else out + in_dtype_of(out, bias)


def _rowwise_call(fn, w, x, bias):
    qa, scale_a, scale_b = _quantized_rows(w, x)
    m, n = qa.shape[0], w.logical_shape[0]
    out = fn(qa, w.qdata, scale_a.expand(m, 1).contiguous(), scale_b.reshape(-1, 1).expand(n, 1).contiguous(),
             bias, x.dtype)
    return out.reshape(*x.shape[:-1], n)


def _fnuz_on_nvidia(w, x) -> bool:
    """float8 x float8 on AMD fnuz codes (Note [float8 fnuz] in core/qdtype.py) on a CUDA device that is not ROCm:
    cuBLASLt's float8 matmul (torch._scaled_mm there) takes OCP e4m3fn / e5m2 only. On ROCm (MI300) and on CPU
    torch._scaled_mm takes fnuz operands as they are."""
    return w.qdtype.is_fnuz and x.is_cuda and torch.version.hip is None and scaled_mm_applies(w, x)


FNUZ_ON_NVIDIA_ROUTE = Route(
    "fnuz float8 act x per-tensor / per-row fnuz weight on an NVIDIA GPU", _fnuz_on_nvidia,
    op="torchqkit::scaled_mm_fp8_rowwise", call=_rowwise_call,
    why="torch._scaled_mm on NVIDIA GPUs takes OCP float8 only; the op decodes fnuz bytes (its Triton kernel on a "
        "GPU, else its reference)",
    act_dtypes=(torch.float32, torch.bfloat16, torch.float16))

SCALED_MM_ROUTE = Route(
    "float8 act x per-tensor / per-row float8 weight", scaled_mm_applies,
    op="torchqkit::scaled_mm_fp8_rowwise", call=_rowwise_call, aten=scaled_mm_linear, aten_name="aten._scaled_mm",
    why="torch._scaled_mm (cuBLASLt on a GPU; torch's CPU _scaled_mm is itself a slow reference implementation)",
    act_dtypes=(torch.float32, torch.bfloat16, torch.float16))


def _float8_act_on_cpu(w, x) -> bool:
    """float8 x float8 under KernelPreference.AUTO on a CPU (TRITON / CUDA name the op below: scaled_mm_fp8_rowwise)."""
    spec = w.act_quant
    return (spec is not None and spec.qdtype.kind is QKind.FLOAT8 and w.qdtype.kind is QKind.FLOAT8
            and w.kernel_preference is KernelPreference.AUTO and x.device.type == "cpu")


FLOAT8_ON_CPU_ROUTE = Route(
    "float8 act x float8 weight on a CPU (any weight scales): the weight-only kernel on the fake-quantized "
    "activation", _float8_act_on_cpu, op="torchqkit::linear_fp8wo", call=on_fake_quantized_input(fp8_weight_only_call),
    why="torch's CPU _scaled_mm is a reference implementation (65 ms for one token of a 4096 x 4096 layer, against "
        "0.36 ms through linear_fp8wo): Note [Activations fake-quantized before a weight-only kernel]",
    grouped=GroupedRoute("torchqkit::grouped_linear_fp8wo",
                         grouped_on_fake_quantized_input(fp8_weight_only_grouped_call)))

# What the float8-storing layouts list first: the fnuz-on-NVIDIA case, the CPU's, then the one torch._scaled_mm serves.
SCALED_MM_ROUTES = (FNUZ_ON_NVIDIA_ROUTE, FLOAT8_ON_CPU_ROUTE, SCALED_MM_ROUTE)
