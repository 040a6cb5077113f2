"""The ops mixture-of-experts code calls on a quantized expert stack (E, N, K): see Note [Expert weights].

What transformers 5.x's expert implementations call on the 3-d Parameter, and what serves it here:
  "eager"       ``self.gate_up_proj[expert_idx]`` (aten.select.int), then ``F.linear`` on the 2-d view
  expert parallelism  ``w[start:end]`` (aten.slice.Tensor along dim 0): a stack of whole experts, views
  "grouped_mm"  ``w.transpose(-2, -1)`` (aten.transpose.int), then ``torch._grouped_mm(x, wt, offs=offs)``;
                under torch.compile with a non-bfloat16 weight, its fallback op ``transformers::grouped_mm_fallback``
  "batched_mm"  ``w[expert_ids]`` (aten.index.Tensor: an ExpertSelection, nothing copied), then
                ``torch.bmm(w_sel, x.unsqueeze(-1))`` (or ``torch.bmm(x.unsqueeze(1), w_sel)`` for experts stored
                transposed)
Both matmuls become the grouped quantized linear (Note [Grouped quantized linear]); detach / clone / ``to`` /
``copy_`` are the generic ops, which work on inner tensors of any rank. Anything else raises UnsupportedOpError.
"""
from __future__ import annotations

import torch

from .affine_quantized_tensor import AffineQuantizedTensor
from .dispatch import EXPERT_OPS, fill_defaults
from .expert_selection import ExpertSelection
from .experts import expert_range, expert_view, gather_experts
from .generic_ops import _clone, _copy_, _detach, _to_copy
from .grouped_linear import grouped_linear
from ..layouts.aliasing import return_view

aten = torch.ops.aten

EXPERT_OPS.implements(aten.detach.default, aten.alias.default)(_detach)
EXPERT_OPS.implements(aten.clone.default)(_clone)
EXPERT_OPS.implements(aten._to_copy.default)(_to_copy)
EXPERT_OPS.implements(aten.copy_.default)(_copy_)


@EXPERT_OPS.implements(aten.select.int)
def _select(func, args, kwargs):
    w, dim, index = fill_defaults(args, 3, [])
    if dim % 3 != 0:
        raise IndexError(f"select(dim={dim}) of a quantized expert stack {tuple(w.shape)}: only dim 0 (one expert) "
                         f"selects a quantized weight; call .dequantize() first for other dims")
    return return_view(func, args, kwargs, lambda: expert_view(w, index))


@EXPERT_OPS.implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    w, dim, start, end, step = fill_defaults(args, 5, [0, None, None, 1])
    count = w.shape[0]
    if dim % 3 != 0 or step != 1:
        raise IndexError(f"slice(dim={dim}, step={step}) of a quantized expert stack {tuple(w.shape)}: only a range of "
                         f"whole experts (dim 0, step 1) is a quantized stack; call .dequantize() first for other "
                         f"slices")
    start, end = slice(start, end).indices(count)[:2]
    return return_view(func, args, kwargs, lambda: expert_range(w, start, max(start, end)))


@EXPERT_OPS.implements(aten.index.Tensor)
def _index(func, args, kwargs):
    w, indices = args[0], args[1]
    if len(indices) != 1 or indices[0] is None or indices[0].dtype == torch.bool:
        raise IndexError(f"indexing a quantized expert stack {tuple(w.shape)} takes one tensor of expert ids "
                         f"(w[ids]); call .dequantize() first for anything else")
    ids = indices[0]
    if ids.dim() == 0:  # w[tensor(e)]: expert e, from a one-expert gather (index is not a view op)
        return expert_view(gather_experts(w, ids.reshape(1)), 0)
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise IndexError(f"a quantized expert stack is indexed by a 1-d tensor of expert ids (int64 / int32), got a "
                         f"{ids.dtype} tensor of shape {tuple(ids.shape)}")
    return ExpertSelection(w, ids.to(torch.int64))  # no bytes copied: Note [Expert selection]


@EXPERT_OPS.implements(aten.transpose.int)
def _transpose(func, args, kwargs):
    w, d0, d1 = fill_defaults(args, 3, [])
    if {d0 % 3, d1 % 3} != {1, 2}:
        raise ValueError(f"transpose({d0}, {d1}) of a quantized expert stack {tuple(w.shape)}: only the last two "
                         f"dims swap (the expert dim stays first)")
    return return_view(func, args, kwargs, lambda: w.with_changes(transposed=not w.transposed))


def _logical_stack(w: AffineQuantizedTensor, op: str) -> AffineQuantizedTensor:
    """The (E, N, K) stack a matmul's right operand (E, K, N) is the transposed view of."""
    if not isinstance(w, AffineQuantizedTensor) or not w.transposed:
        what = "a quantized left operand" if not isinstance(w, AffineQuantizedTensor) else "an untransposed stack"
        raise NotImplementedError(f"{op} with {what}: only x @ W.transpose(-2, -1) (each expert's linear) is served "
                                  f"for a quantized expert stack; call .dequantize() first")
    return w.with_changes(transposed=False)


@EXPERT_OPS.implements(aten._grouped_mm.default, "transformers::grouped_mm_fallback")
def _grouped_mm(func, args, kwargs):
    x, wt, offs = fill_defaults(args, 3, [kwargs.get("offs")])
    if offs is None or kwargs.get("bias") is not None or len(args) > 3:
        raise NotImplementedError("torch._grouped_mm on a quantized expert stack takes (x, W.transpose(-2, -1), "
                                  "offs=...): no bias and no 3-d input; add the bias afterwards")
    out_dtype = kwargs.get("out_dtype")
    y = grouped_linear(x, _logical_stack(wt, "torch._grouped_mm"), offs)
    return y if out_dtype is None else y.to(out_dtype)


@EXPERT_OPS.implements(aten.bmm.default)
def _bmm(func, args, kwargs):
    a, b = args[0], args[1]
    if isinstance(a, AffineQuantizedTensor) and not a.transposed and not isinstance(b, AffineQuantizedTensor):
        # W (S, N, K) @ x (S, K, P): transformers' batched experts; per s, linear(x[s].T, W[s]).T
        s, k, p = b.shape
        y = grouped_linear(b.transpose(1, 2).reshape(s * p, k), a, _every(s, p, b.device))
        return y.reshape(s, p, -1).transpose(1, 2)
    w = _logical_stack(b, "torch.bmm")  # x (S, P, K) @ W.transpose(-2, -1): per s, linear(x[s], W[s])
    s, p, k = a.shape
    return grouped_linear(a.reshape(s * p, k), w, _every(s, p, a.device)).reshape(s, p, -1)


def _every(s: int, p: int, device) -> torch.Tensor:
    """Group ends of a batched matmul: each of the s matrices is its own group of p rows."""
    return torch.arange(1, s + 1, device=device, dtype=torch.int64) * p
