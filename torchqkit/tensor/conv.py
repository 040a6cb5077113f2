"""``aten.convolution`` with a quantized 1x1 weight: the layout's linear on the channel dim.

A 1x1 convolution is a Linear applied at every position: out[n, :, p] = W x[n, :, p] + b. quantize_ stores
such a conv's weight (out, in, 1[, 1]) as a 2-d (out, in) quantized weight (Note [Weight-bearing modules] in
api/weight_modules.py); here the input is zero-padded, subsampled by the stride, its channel dim moved last,
run through ``F.linear`` (the layout's kernel) and moved back. Dilation does nothing to a 1x1 kernel. Anything
else (a k x k weight, groups, a transposed convolution, a quantized input) is refused with the reason: never a
silent dequantize.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .affine_quantized_tensor import AffineQuantizedTensor
from .dispatch import fill_defaults

__all__ = ["convolution"]


def convolution(func, args, kwargs):
    """``aten.convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``."""
    x, w, bias, stride, padding, _dilation, transposed, _output_padding, groups = fill_defaults(args, 9, [])
    if isinstance(x, AffineQuantizedTensor) or not isinstance(w, AffineQuantizedTensor):
        raise NotImplementedError("convolution reads quantized weights only: the input must be a plain tensor; "
                                  "call .dequantize() on it")
    if w.dim() != 2 or w.transposed:
        raise NotImplementedError(f"convolution with a quantized weight of shape {tuple(w.shape)}: torchqkit "
                                  f"serves 1x1 convolutions, whose weight it stores as (out, in); dequantize it "
                                  f"for anything else")
    if transposed or groups != 1:
        raise NotImplementedError(f"convolution with a quantized weight: transposed={transposed}, groups={groups}; "
                                  f"only a plain 1x1 convolution (groups=1) runs as a quantized linear")
    if any(padding):
        pad = [p for p in reversed(padding) for _ in range(2)]  # F.pad lists the last dim first
        x = F.pad(x, pad)
    x = x[(slice(None), slice(None), *(slice(None, None, s) for s in stride))] if any(s != 1 for s in stride) else x
    y = w.linear(x.movedim(1, -1), bias)  # the layout's linear (F.linear is not caught under dispatch)
    return y.movedim(-1, 1).contiguous()
