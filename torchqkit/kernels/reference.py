"""Pure-PyTorch reference of every custom op in ``schemas.py`` (ggml's ``*_ref`` idea).

Registered as the CompositeExplicitAutograd kernel, so each op runs on every device even when no
compiled backend exists; a backend registered for a specific dispatch key (e.g. the C++ CPU kernels)
takes precedence. The numerics come from the oracle, ``core/primitives.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.primitives import MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine, quantize_affine
from ..core.qdtype import int8
from .schemas import OPS  # the ops must exist before kernels are registered for them

__all__ = ["linear_int8wo_plain_ref", "linear_int8da_int8_plain_ref"]


def _bias32(bias):
    return None if bias is None else bias.float()


def linear_int8wo_plain_ref(x, qdata, scale, bias=None):
    k = qdata.shape[1]
    w = dequantize_affine(qdata, int8, (1, k // scale.shape[1]), scale, output_dtype=torch.float32, name="weight")
    return F.linear(x.float(), w, _bias32(bias)).to(x.dtype)


def linear_int8da_int8_plain_ref(x, qdata, scale, bias=None, act_symmetric=True):
    k = qdata.shape[1]
    x2 = x.reshape(-1, k).float()
    mapping = MappingType.SYMMETRIC if act_symmetric else MappingType.ASYMMETRIC
    zpd = ZeroPointDomain.NONE if act_symmetric else ZeroPointDomain.INT
    a_scale, a_zp = choose_qparams_affine(x2, int8, (1, k), mapping=mapping, zero_point_domain=zpd,
                                          scale_dtype=torch.float32, check_finite=False, name="activation")
    qa = quantize_affine(x2, int8, (1, k), a_scale, a_zp, check_finite=False, name="activation").float()
    if a_zp is not None:
        qa = qa - a_zp.float()
    # Integer products summed in float32: exact while partial sums stay below 2**24, then ~1e-7 relative.
    acc = qa @ qdata.float().t()
    out = acc * (a_scale * scale.reshape(1, -1).float())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qdata.shape[0])


# torch.library.impl's decorator form returns None here, so register explicitly and keep the functions.
for _name, _fn in (("torchqkit::linear_int8wo_plain", linear_int8wo_plain_ref),
                   ("torchqkit::linear_int8da_int8_plain", linear_int8da_int8_plain_ref)):
    torch.library.impl(_name, "CompositeExplicitAutograd", _fn)


# ------------------------------------------------------------------------------------------------
# autograd (both ops): d/dx through the dequantized weight; the dynamic op treats its activation
# rounding as the identity (straight-through), as quantization-aware training does. No weight gradient.
# ------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    x, qdata, scale, bias = inputs[:4]
    ctx.save_for_backward(qdata, scale)
    ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype


def _backward(ctx, grad):
    qdata, scale = ctx.saved_tensors
    k = qdata.shape[1]
    w = dequantize_affine(qdata, int8, (1, k // scale.reshape(qdata.shape[0], -1).shape[1]),
                          scale.reshape(qdata.shape[0], -1), output_dtype=torch.float32, name="weight")
    grad_x = (grad.float() @ w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    grad_bias = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)
    return (grad_x, None, None, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 4)


for _name in OPS:
    torch.library.register_autograd(_name, _backward, setup_context=_setup_context)
