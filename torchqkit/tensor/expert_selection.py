"""ExpertSelection: ``w[expert_ids]`` of a quantized expert stack, without copying any expert's bytes.

Note [Expert selection]
~~~~~~~~~~~~~~~~~~~~~~~
transformers' "batched_mm" experts gather one weight per (token, top-k slot): ``w[expert_ids]`` of shape (S, N, K)
with S = tokens x top_k, then ``torch.bmm``. Gathered for real, that is S copies of expert weights (the float path
does exactly that), most of them repeats at prefill. For a quantized stack the result is this small wrapper
instead: the stack itself plus the ids, shaped (S, N, K) (or (S, K, N) for a transposed stack). Its ``bmm`` sorts
the rows by expert and runs the grouped quantized linear on the stack (Note [Grouped quantized linear]): each
routed expert's bytes are read once, by its layout's kernel, and nothing is copied but the activations. It
flattens into (stack, ids) for torch.compile. Any other op raises UnsupportedOpError; ``dequantize()`` gives the
float gather.
"""
from __future__ import annotations

import torch

from .dispatch import OpTable, UnsupportedOpError
from .grouped_linear import grouped_linear
from ..layouts.aliasing import return_view

__all__ = ["ExpertSelection"]

aten = torch.ops.aten
SELECTION_OPS = OpTable("ExpertSelection")


class ExpertSelection(torch.Tensor):
    """Experts ``ids`` of a quantized stack (what ``stack[ids]`` returns): see Note [Expert selection].

    stack: an (E, N, K) AffineQuantizedTensor (possibly transposed: outer (E, K, N)); ids: (S,) int64 expert ids.
    The outer shape is (S, *stack.shape[1:]), the dtype the stack's.
    """

    @staticmethod
    def __new__(cls, stack, ids):
        shape = (ids.shape[0], *stack.shape[1:])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=stack.dtype, device=stack.device,
                                                   requires_grad=False)

    def __init__(self, stack, ids):
        self.stack, self.ids = stack, ids

    def __tensor_flatten__(self):
        return ["stack", "ids"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return ExpertSelection(inner_tensors["stack"], inner_tensors["ids"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fn = SELECTION_OPS.get(func)
        if fn is None:
            raise UnsupportedOpError(func, "ExpertSelection (experts chosen from a quantized stack)",
                                     SELECTION_OPS.fns)
        return fn(func, args, kwargs or {})

    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float gather ``stack.dequantize()[ids]``."""
        return self.stack.dequantize(output_dtype)[self.ids]

    def __repr__(self) -> str:
        return f"ExpertSelection({self.ids.shape[0]} of {self.stack!r})"


@SELECTION_OPS.implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    sel = args[0]
    return return_view(func, args, kwargs, lambda: ExpertSelection(func(sel.stack), func(sel.ids)))


@SELECTION_OPS.implements(aten.transpose.int)
def _transpose(func, args, kwargs):
    sel = args[0]
    return return_view(func, args, kwargs, lambda: ExpertSelection(func(sel.stack, *args[1:]), sel.ids))


@SELECTION_OPS.implements(aten.bmm.default)
def _bmm(func, args, kwargs):
    a, b = args[0], args[1]
    if isinstance(a, ExpertSelection) and not a.stack.transposed and not isinstance(b, ExpertSelection):
        # W (S, N, K) @ x (S, K, P): per s, linear(x[s].T, W[s]).T
        s, k, p = b.shape
        return _grouped_rows(a, b.transpose(1, 2)).transpose(1, 2)
    if isinstance(b, ExpertSelection) and b.stack.transposed and not isinstance(a, ExpertSelection):
        return _grouped_rows(b, a)  # x (S, P, K) @ W (S, K, N), W stored (E, N, K): per s, linear(x[s], W[s])
    raise NotImplementedError("torch.bmm with experts chosen from a quantized stack serves W @ x (experts stored "
                              "(E, N, K)) and x @ W (experts stored (E, K, N)) only; call .dequantize() first")


def _grouped_rows(sel: ExpertSelection, x: torch.Tensor) -> torch.Tensor:
    """(S, P, K) rows, x[s] for expert ids[s] -> (S, P, N): sorted by expert, one grouped linear, put back."""
    s, p, k = x.shape
    stack = sel.stack if not sel.stack.transposed else sel.stack.with_changes(transposed=False)
    experts = stack.logical_shape[0]
    order = torch.argsort(sel.ids, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device).index_add_(
        0, sel.ids, torch.ones_like(sel.ids))
    offs = torch.cumsum(counts, 0) * p
    y = grouped_linear(x[order].reshape(s * p, k), stack, offs).reshape(s, p, -1)
    return torch.empty_like(y).index_copy_(0, order, y)
