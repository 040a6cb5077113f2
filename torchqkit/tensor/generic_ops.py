"""Ops every layout gets for free, written once against the declared inner tensors and attributes."""
from __future__ import annotations

import torch

from .affine_quantized_tensor import AffineQuantizedTensor
from .conv import convolution
from .dispatch import GENERIC_OPS, fill_defaults
from .embedding import embedding
from .merge import add_into_
from ..layouts.aliasing import return_view

aten = torch.ops.aten


@GENERIC_OPS.implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    return return_view(func, args, kwargs, lambda: args[0].map_tensors(func))


@GENERIC_OPS.implements(aten.clone.default)
def _clone(func, args, kwargs):
    memory_format = kwargs.get("memory_format")
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        raise ValueError(f"clone of a quantized weight supports no memory_format={memory_format}")
    return args[0].map_tensors(torch.clone)


@GENERIC_OPS.implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    self: AffineQuantizedTensor = args[0]
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"a quantized weight can only be viewed as a floating dtype, not {dtype}; "
                        f"call .dequantize() first")
    non_blocking = kwargs.get("non_blocking", False)
    # The outer dtype only says what dequantize() returns; scales keep their dtype so nothing is re-rounded.
    return self.map_tensors(lambda t: t.to(device=device, non_blocking=non_blocking) if device else t.clone(),
                            orig_dtype=dtype or self.orig_dtype)


@GENERIC_OPS.implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(src, AffineQuantizedTensor) or src.attributes() != dst.attributes() or any(
            (a is None) != (b is None) or (a is not None and a.shape != b.shape)
            for a, b in zip(dst.inner_tensors().values(), src.inner_tensors().values())):
        got = repr(src) if isinstance(src, AffineQuantizedTensor) else f"a plain {src.dtype} tensor"
        raise ValueError(f"copy_ into {dst!r} needs a quantized tensor of the same format, got {got}. "
                         f"Quantize the source with the same config, or load with load_state_dict(..., assign=True).")
    for a, b in zip(dst.inner_tensors().values(), src.inner_tensors().values()):
        if a is not None:
            a.copy_(b)
    return dst


@GENERIC_OPS.implements(aten.add_.Tensor, aten.sub_.Tensor, aten.add_.Scalar, aten.sub_.Scalar)
def _add_(func, args, kwargs):
    """A LoRA merge (``weight.data += delta``) or unmerge: see Note [Merging into a quantized weight]."""
    self, other = args[0], args[1]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    sign = -1 if func in (aten.sub_.Tensor, aten.sub_.Scalar) else 1
    if not isinstance(self, AffineQuantizedTensor):  # plain += quantized
        raise TypeError(f"{func}: adding a quantized weight into a plain tensor; call .dequantize() on it first")
    return add_into_(self, other, sign * alpha, op=func.__name__.split(".")[0])


# Rows of the weight, dequantizing only the tiles that hold them: see Note [Quantized embedding].
GENERIC_OPS.implements(aten.embedding.default)(embedding)
# A 1x1 convolution as the layout's linear on the channel dim (tensor/conv.py).
GENERIC_OPS.implements(aten.convolution.default)(convolution)


@GENERIC_OPS.implements(aten.t.default)
def _t(func, args, kwargs):
    self = args[0]
    if self.dim() != 2:
        raise ValueError(f"t() of a {self.dim()}-d quantized tensor; only 2-d weights transpose")
    return return_view(func, args, kwargs, lambda: self.with_changes(transposed=not self.transposed))


@GENERIC_OPS.implements(aten.transpose.int)
def _transpose(func, args, kwargs):
    self, d0, d1 = fill_defaults(args, 3, [])
    if self.dim() != 2 or {d0 % 2, d1 % 2} != {0, 1}:
        raise ValueError(f"transpose({d0}, {d1}) of a quantized tensor: only swapping the two dims of a 2-d weight")
    return return_view(func, args, kwargs, lambda: self.with_changes(transposed=not self.transposed))


def _matmul(a, b: AffineQuantizedTensor, bias):
    if isinstance(a, AffineQuantizedTensor):
        raise NotImplementedError("matmul with a quantized left operand: only x @ W with W quantized is supported; "
                                  "call .dequantize() on the left operand")
    if b.transposed:  # x @ W.t(): the forward of linear
        return b.t().linear(a, bias)
    out = a @ b.dequantize(a.dtype)  # grad @ W: linear's backward w.r.t. its input
    return out if bias is None else out + bias


@GENERIC_OPS.implements(aten.mm.default)
def _mm(func, args, kwargs):
    return _matmul(args[0], args[1], None)


@GENERIC_OPS.implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if beta != 1 or alpha != 1:
        raise NotImplementedError(f"addmm with beta={beta}, alpha={alpha} on a quantized weight; "
                                  f"only beta=alpha=1 (what F.linear produces) is supported")
    return _matmul(a, b, bias)
