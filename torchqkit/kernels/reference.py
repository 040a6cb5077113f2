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


def _int8_activation_rows(x2: torch.Tensor, act_symmetric: bool):
    """Per-token int8 quantization as the ops do it: (codes minus zero point, as float32; scale (M, 1))."""
    k = x2.shape[1]
    mapping = MappingType.SYMMETRIC if act_symmetric else MappingType.ASYMMETRIC
    zpd = ZeroPointDomain.NONE if act_symmetric else ZeroPointDomain.INT
    a_scale, a_zp = choose_qparams_affine(x2, int8, (1, k), mapping=mapping, zero_point_domain=zpd,
                                          scale_dtype=torch.float32, check_finite=False, name="activation")
    qa = quantize_affine(x2, int8, (1, k), a_scale, a_zp, check_finite=False, name="activation").float()
    # A row holding NaN / Inf gives a NaN output row (as F.linear on the float row would), whatever its codes.
    a_scale = torch.where(torch.isfinite(x2).all(1, keepdim=True), a_scale, float("nan"))
    return (qa if a_zp is None else qa - a_zp.float()), a_scale


def linear_int8da_int8_plain_ref(x, qdata, scale, bias=None, act_symmetric=True):
    k = qdata.shape[1]
    x2 = x.reshape(-1, k).float()
    qa, a_scale = _int8_activation_rows(x2, act_symmetric)
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


# ------------------------------------------------------------------------------------------------
# GPU-first ops (schemas.GPU_OPS): references that read the layouts' bytes as stored. They
# decode the bytes themselves (kernels/ never imports layouts/), which also cross-checks each layout's
# own unpack. No autograd: these ops serve inference.
# ------------------------------------------------------------------------------------------------

_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _linear_f32(x, w, bias):
    return F.linear(x.float(), w, _bias32(bias)).to(x.dtype)


def int4_tiled_codes(qdata):
    """int32 [N8/8][Kt/(16T)][32][T/2] tiles -> (N8, Kt) codes; Note [Tensor-core tiled int4] (layouts)."""
    nc, nw = qdata.shape[1], qdata.shape[3]
    chunk = 32 * nw  # 16 T
    n = torch.arange(qdata.shape[0] * 8, device=qdata.device)
    k = torch.arange(nc * chunk, device=qdata.device)
    rem = k % chunk
    t, h, c, e = rem // 16, (rem % 16) // 8, (rem % 8) // 2, rem % 2
    word = qdata[(n // 8)[:, None], (k // chunk)[None, :], (4 * (n % 8))[:, None] + c[None, :], (t // 2)[None, :]]
    return (word.to(torch.int64) >> (4 * (4 * e + 2 * (t % 2) + h))[None, :]) & 0xF


def linear_int4wo_tiled_ref(x, qdata, scale_and_zero, group_size, out_features, bias=None):
    k = x.shape[-1]
    return _linear_f32(x, int4_tiled_weight(qdata, scale_and_zero, group_size, out_features, k), bias)


def int4_tiled_weight(qdata, scale_and_zero, group_size, n, k):
    """The float32 (n, k) weight of TensorCoreTiledLayout bytes: w = (q - 8) * scale + zero."""
    q = int4_tiled_codes(qdata)[:n, :k].float()
    groups = -(-k // group_size)  # a partial last group (K not a multiple of g) has its own scale and zero
    sz = scale_and_zero[:groups, :n].float().repeat_interleave(group_size, 0)[:k]  # (K, N, 2)
    return (q - 8) * sz[..., 0].t() + sz[..., 1].t()


def nf4_absmax(scale, scale_codes, scale_block_scale, scale_offset):
    """The float32 absmax (N, K / B): stored, or decoded from double quantization (Note [NF4 double quantization])."""
    if scale is not None:
        return scale.float()
    flat = scale_codes.reshape(-1).float()
    blocks = torch.arange(flat.numel(), device=flat.device) // 256
    return (flat * scale_block_scale.float()[blocks] + scale_offset.float()).reshape(scale_codes.shape)


def linear_nf4wo_ref(x, qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size, bias=None):
    from ..core.qdtype import nf4
    codes = torch.stack([qdata >> 4, qdata & 0xF], dim=-1).reshape(qdata.shape[0], -1).long()
    levels = torch.tensor(nf4.levels, dtype=torch.float32, device=qdata.device)
    absmax = nf4_absmax(scale, scale_codes, scale_block_scale, scale_offset)
    return _linear_f32(x, levels[codes] * absmax.repeat_interleave(block_size, 1), bias)


def _expand_blocks(scale, shape):
    """(N / bn, K / bk) -> (N, K) by repeating each block's scale."""
    return scale.float().repeat_interleave(shape[0] // scale.shape[0], 0).repeat_interleave(shape[1] // scale.shape[1], 1)


def linear_fp8wo_ref(x, qdata, scale, bias=None):
    return _linear_f32(x, qdata.float() * _expand_blocks(scale, qdata.shape), bias)


def mx_weight(qdata, scale):
    """MXLayout bytes -> (N, K) float32 weight."""
    if qdata.dtype == torch.uint8:  # MXFP4, low nibble first
        codes = torch.stack([qdata & 0xF, qdata >> 4], dim=-1).reshape(qdata.shape[0], -1).long()
        elems = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=qdata.device)[codes]
    else:
        elems = qdata.float()
    e = scale.to(torch.int32)
    x_scale = torch.where(e == 0, 0x00400000, e << 23).view(torch.float32)  # E8M0: 2^(e - 127)
    return elems * x_scale.repeat_interleave(32, 1)


def linear_mxwo_ref(x, qdata, scale, bias=None):
    return _linear_f32(x, mx_weight(qdata, scale), bias)


def scaled_mm_fp8_rowwise_ref(a, b, scale_a, scale_b, bias=None, out_dtype=torch.float32):
    out = (a.float() @ b.float().t()) * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)


for _name, _fn in (("torchqkit::linear_int4wo_tiled", linear_int4wo_tiled_ref),
                   ("torchqkit::linear_nf4wo", linear_nf4wo_ref), ("torchqkit::linear_fp8wo", linear_fp8wo_ref),
                   ("torchqkit::linear_mxwo", linear_mxwo_ref),
                   ("torchqkit::scaled_mm_fp8_rowwise", scaled_mm_fp8_rowwise_ref)):
    torch.library.impl(_name, "CompositeExplicitAutograd", _fn)



# ------------------------------------------------------------------------------------------------
# Low-bit weight-only ops served by C++ CPU kernels (schemas.LOWBIT_CPU_OPS): linear_intxwo's
# reference, and d/dx for all four (QLoRA trains adapters through a frozen NF4 weight): grad @ W, W
# decoded from the stored bytes. No weight gradient; the bias gets one.
# ------------------------------------------------------------------------------------------------

def intx_fields(qdata, bits, k):
    """(N, ceil(K * bits / 8)) uint8 -> (N, K) int64 offset-binary fields (Note [Packed intx bits], layouts)."""
    bit = torch.arange(k, device=qdata.device) * bits
    byte = bit // 8
    word = qdata[:, byte].long() | (qdata[:, (byte + 1).clamp(max=qdata.shape[1] - 1)].long() << 8)
    return (word >> (bit % 8)) & ((1 << bits) - 1)


def intx_weight(qdata, scale, zero_point, bits, signed, zero_point_domain, k):
    from ..core.qdtype import INT, UINT
    qdtype = (INT if signed else UINT)[bits]
    codes = intx_fields(qdata, bits, k) + int(qdtype.qmin)
    block = (qdata.shape[0] // scale.shape[0], k // scale.shape[1])
    return dequantize_affine(codes, qdtype, block, scale, zero_point, zero_point_domain=zero_point_domain,
                             name="packed intx weight")


def linear_intxwo_ref(x, qdata, scale, zero_point, bits, signed, zero_point_domain, bias=None):
    return _linear_f32(x, intx_weight(qdata, scale, zero_point, bits, signed, zero_point_domain, x.shape[-1]), bias)


def nf4_weight(qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size):
    from ..core.qdtype import nf4
    codes = torch.stack([qdata >> 4, qdata & 0xF], dim=-1).reshape(qdata.shape[0], -1).long()
    levels = torch.tensor(nf4.levels, dtype=torch.float32, device=qdata.device)
    absmax = nf4_absmax(scale, scale_codes, scale_block_scale, scale_offset)
    return levels[codes] * absmax.repeat_interleave(block_size, 1)


torch.library.impl("torchqkit::linear_intxwo", "CompositeExplicitAutograd", linear_intxwo_ref)

_LOWBIT_WEIGHTS = {  # op -> (weight args..., k) -> (N, K) float32
    "torchqkit::linear_nf4wo": lambda *a, k: nf4_weight(*a),
    "torchqkit::linear_fp8wo": lambda qdata, scale, k: qdata.float() * _expand_blocks(scale, qdata.shape),
    "torchqkit::linear_intxwo": lambda *a, k: intx_weight(*a, k),
    "torchqkit::linear_mxwo": lambda qdata, scale, k: mx_weight(qdata, scale),
}


def _setup_weight_only(ctx, inputs, output):
    x, *weight, bias = inputs
    ctx.tensor_idx = [i for i, a in enumerate(weight) if isinstance(a, torch.Tensor)]
    ctx.save_for_backward(*(weight[i] for i in ctx.tensor_idx))
    ctx.weight = [None if i in ctx.tensor_idx else a for i, a in enumerate(weight)]
    ctx.k, ctx.x_dtype, ctx.bias_dtype = x.shape[-1], x.dtype, None if bias is None else bias.dtype


def _weight_only_backward(op):
    def backward(ctx, grad):
        weight = list(ctx.weight)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            weight[i] = t
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.float() @ _LOWBIT_WEIGHTS[op](*weight, k=ctx.k)).to(ctx.x_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[-1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)
        return (grad_x, *([None] * len(weight)), grad_bias)
    return backward


for _name in _LOWBIT_WEIGHTS:
    torch.library.register_autograd(_name, _weight_only_backward(_name), setup_context=_setup_weight_only)


# autograd for linear_int4wo_tiled (CPU kernel): d/dx through the dequantized weight, no weight gradient.
def _int4_tiled_setup_context(ctx, inputs, output):
    x, qdata, scale_and_zero, group_size, out_features, bias = inputs
    ctx.save_for_backward(qdata, scale_and_zero)
    ctx.meta = (group_size, out_features, x.shape[-1], x.dtype, None if bias is None else bias.dtype)


def _int4_tiled_backward(ctx, grad):
    qdata, scale_and_zero = ctx.saved_tensors
    g, n, k, x_dtype, bias_dtype = ctx.meta
    w = int4_tiled_weight(qdata, scale_and_zero, g, n, k)
    grad_x = (grad.float() @ w).to(x_dtype) if ctx.needs_input_grad[0] else None
    grad_bias = None
    if bias_dtype is not None and ctx.needs_input_grad[5]:
        grad_bias = grad.reshape(-1, n).float().sum(0).to(bias_dtype)
    return grad_x, None, None, None, None, grad_bias


torch.library.register_autograd("torchqkit::linear_int4wo_tiled", _int4_tiled_backward,
                                setup_context=_int4_tiled_setup_context)


# ------------------------------------------------------------------------------------------------
# linear_int8da_int4_packed: per-token int8 activation (the oracle, as linear_int8da_int8_plain)
# times the dequantized int4 PackedIntxLayout weight; autograd d/dx straight through the rounding.
# ------------------------------------------------------------------------------------------------

def _int4_packed_weight(qdata, scale, zero_point, k):
    n = qdata.shape[0]
    u = torch.stack([qdata & 0xF, qdata >> 4], dim=-1).reshape(n, -1)[:, :k].float()
    g = k // scale.shape[1]
    c = 8.0 if zero_point is None else 8.0 + zero_point.float().repeat_interleave(g, 1)
    return (u - c) * scale.float().repeat_interleave(g, 1)


def linear_int8da_int4_packed_ref(x, qdata, scale, zero_point, bias=None, act_symmetric=True):
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    qa, a_scale = _int8_activation_rows(x2, act_symmetric)
    out = (qa @ _int4_packed_weight(qdata, scale, zero_point, k).t()) * a_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qdata.shape[0])


def _int8da_int4_setup_context(ctx, inputs, output):
    x, qdata, scale, zero_point, bias = inputs[:5]
    ctx.save_for_backward(qdata, scale, zero_point)
    ctx.meta = (x.shape[-1], x.dtype, None if bias is None else bias.dtype)


def _int8da_int4_backward(ctx, grad):
    qdata, scale, zero_point = ctx.saved_tensors
    k, x_dtype, bias_dtype = ctx.meta
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = (grad.float() @ _int4_packed_weight(qdata, scale, zero_point, k)).to(x_dtype)
    grad_bias = None
    if bias_dtype is not None and ctx.needs_input_grad[4]:
        grad_bias = grad.reshape(-1, qdata.shape[0]).float().sum(0).to(bias_dtype)
    return grad_x, None, None, None, grad_bias, None


torch.library.impl("torchqkit::linear_int8da_int4_packed", "CompositeExplicitAutograd", linear_int8da_int4_packed_ref)
torch.library.register_autograd("torchqkit::linear_int8da_int4_packed", _int8da_int4_backward,
                                setup_context=_int8da_int4_setup_context)
