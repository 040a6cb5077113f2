"""Every torchqkit custom op: its schema and its fake impl (shapes and dtypes only), side by side.

Op names say the math and the format, never the device (see STYLE.md §2); the dispatch key picks the
backend. Each op also has a pure-PyTorch reference (``reference.py``, registered for every device as the
CompositeExplicitAutograd kernel) and, where built, a C++ CPU kernel (``csrc/cpu``, registered for the
CPU dispatch key, which takes precedence over the reference).

Ops
---
linear_int8wo_plain(x, qdata, scale, bias)
    Weight-only int8 linear on PlainLayout bytes: ``y = x @ (qdata * scale).T + bias``.
    x: (..., K) float32 / bfloat16 / float16; qdata: (N, K) int8 codes (symmetric, no zero point);
    scale: (N, G), G dividing K (G = 1: per channel, else group size K / G); bias: (N) or None.
    Returns (..., N) in x.dtype; computed in float32.
linear_int8da_int8_plain(x, qdata, scale, bias, act_symmetric)
    int8 dynamic activation x int8 weight: each row of x is quantized per token inside the op (symmetric,
    or asymmetric with an integer zero point; the oracle's choose_qparams / quantize_affine numerics),
    then an exact integer matmul, then ``* act_scale * scale + bias``.
    qdata: (N, K) int8 symmetric per-channel codes; scale: (N, 1). Returns (..., N) in x.dtype.
"""
from __future__ import annotations

import torch

__all__ = ["OPS"]

OPS = ("torchqkit::linear_int8wo_plain", "torchqkit::linear_int8da_int8_plain")


def _linear_out(x, qdata, name):
    torch._check(qdata.dim() == 2, lambda: f"{name}: qdata must be 2-D (N, K), got {tuple(qdata.shape)}")
    torch._check(x.shape[-1] == qdata.shape[1],
                 lambda: f"{name}: x has {x.shape[-1]} features but the weight has K = {qdata.shape[1]}")
    return x.new_empty(*x.shape[:-1], qdata.shape[0])


torch.library.define(
    "torchqkit::linear_int8wo_plain",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None) -> Tensor")


@torch.library.register_fake("torchqkit::linear_int8wo_plain")
def _linear_int8wo_plain_fake(x, qdata, scale, bias=None):
    return _linear_out(x, qdata, "linear_int8wo_plain")


torch.library.define(
    "torchqkit::linear_int8da_int8_plain",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None, bool act_symmetric=True) -> Tensor")


@torch.library.register_fake("torchqkit::linear_int8da_int8_plain")
def _linear_int8da_int8_plain_fake(x, qdata, scale, bias=None, act_symmetric=True):
    return _linear_out(x, qdata, "linear_int8da_int8_plain")
