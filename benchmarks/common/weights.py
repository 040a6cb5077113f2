"""A preset's quantized weight for one matrix, and the direct call of the op its layout routes F.linear to.

The op is called on the layout's stored tensors through the route torchqkit itself takes (torchqkit.layouts.routes),
looked up once per weight and activation dtype: the timing holds the kernel, not the Python dispatch around it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.layouts.routes import route_for

from .configs import build


def stored_bytes(t) -> int:
    """Bytes a call reads from the weight: a quantized weight's stored tensors (codes, scales, zero points)."""
    if isinstance(t, qk.AffineQuantizedTensor):
        return sum(v.numel() * v.element_size() for v in t.inner_tensors().values() if v is not None)
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def preset_weight(name: str, w: torch.Tensor):
    """`w` (N, K) quantized by the config named `name`, as quantize_ quantizes an nn.Linear holding it."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        lin.weight.copy_(w)
    report = qk.quantize_(lin, build(name))
    if not isinstance(lin.weight, qk.AffineQuantizedTensor):
        raise ValueError(f"{name}: quantize_ left the ({w.shape[0]}, {w.shape[1]}) weight float: {report}")
    return lin.weight


def direct_call(w, x: torch.Tensor):
    """(fn(weight) -> y, what serves it): F.linear(x, weight) through the op the layout routes to, without dispatch.
    `fn` takes the weight as its argument, so a Timer can hand it each copy of a ring."""
    route = route_for(w, x)
    if route is None:  # no kernel serves this case: the reference (dequantize + F.linear), as F.linear would run
        return (lambda q: F.linear(x, q)), "reference"
    if route.aten is not None:
        return (lambda q: route.aten(q, x, None)), route.aten_name
    op = route.dispatched_op
    return (lambda q: route.call(op, q, x, None)), route.op
