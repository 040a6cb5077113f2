"""Expert weights: a stack of E quantized 2-d weights that share one format, stored as one 3-d tensor.

Note [Expert weights]
~~~~~~~~~~~~~~~~~~~~~
Mixture-of-experts models keep their experts as 3-d Parameters: ``gate_up_proj`` (E, 2I, H), ``down_proj``
(E, H, I), i.e. E weights of shape (N, K). Their quantized form is an AffineQuantizedTensor with
``logical_shape`` (E, N, K) and ``block_size`` (1, bn, bk): every expert is quantized on its own (its own group
qparams) into the same layout, and each of the layout's inner tensors is the stack of the E experts' packed
tensors along a new leading dim, e.g. TensorCoreTiledLayout's ``qdata`` [E][N8 / 8][Kt / (16 T)][32][T / 2]
and ``scale_and_zero`` [E][Kt / g][N8][2], PlainLayout's ``qdata`` [E][N][K] and ``scale`` [E][N][K / g].

Nothing in a layout knows about experts. ``w[e]`` / ``w.select(0, e)`` (``expert_view``) is an ordinary 2-d
AffineQuantizedTensor whose inner tensors are ``t[e]``: views of the stack's storage (no copy), and, because
the stack is contiguous, contiguous themselves, which is all any layout's 2-d kernels (C++ CPU, CUDA, Triton)
ask of their operands. So ``F.linear(x, w[e])`` runs the layout's existing linear unchanged, and the grouped and
batched matmuls (``torch._grouped_mm``, ``torch.bmm``; expert_ops.py) run it once per expert that has tokens
(grouped_linear.py). What each layout needs is exactly what it needs for one 2-d weight: a layout whose
``supports`` refuses (N, K) (or whose padding rules can't take K) refuses the experts too, naming the expert.

A stack is never transposed in its first dim: ``transposed`` swaps the last two dims only (``w.transpose(-2,
-1)``, what transformers hands ``torch._grouped_mm``). The layouts' own ops (slice, the 2-d linear) are not
applied to a stack; its ops live in ``EXPERT_OPS`` (expert_ops.py).
"""
from __future__ import annotations

import torch

__all__ = ["expert_view", "stack_experts", "gather_experts", "expert_range"]


def expert_view(w, e: int):
    """Expert ``e`` of the stack ``w`` (E, N, K): a 2-d quantized weight whose inner tensors are views of ``w``'s
    (no copy). See Note [Expert weights]."""
    count = w.logical_shape[0]
    if not -count <= e < count:
        raise IndexError(f"expert {e} of a stack of {count} quantized experts")
    attrs = w.attributes()
    attrs.update(block_size=w.block_size[1:], logical_shape=w.logical_shape[1:])
    tensors = {n: None if t is None else t[e] for n, t in w.inner_tensors().items()}
    return type(w)(tensors, **attrs)


def gather_experts(w, ids: torch.Tensor):
    """The stack of experts ``ids`` (1-d int64, repeats allowed) of ``w``: a new (len(ids), N, K) stack whose inner
    tensors are ``index_select`` copies of the chosen experts' packed bytes only (what ``w[ids]`` gives)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise IndexError(f"a stack of quantized experts is indexed by a 1-d tensor of expert ids (int64 / int32), "
                         f"got a {ids.dtype} tensor of shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    tensors = {n: None if t is None else t.index_select(0, ids) for n, t in w.inner_tensors().items()}
    return w.with_changes(tensors, logical_shape=(ids.shape[0], *w.logical_shape[1:]))


def expert_range(w, start: int, end: int):
    """Experts ``[start, end)`` of the stack ``w``: an (end - start, N, K) stack whose layout tensors are views of
    ``w``'s (no copy; contiguous, as slices of the leading dim of contiguous tensors are). An ``input_scale``
    (K,) belongs to every expert and is kept whole. What an expert-parallel shard holds."""
    count = w.logical_shape[0]
    if not 0 <= start <= end <= count:
        raise IndexError(f"experts [{start}, {end}) of a stack of {count} quantized experts")
    tensors = {n: None if getattr(w, n) is None else getattr(w, n)[start:end] for n in w.qlayout.tensor_names}
    return w.with_changes(tensors, logical_shape=(end - start, *w.logical_shape[1:]))


def stack_experts(weights: list, name: str = "experts"):
    """One (E, N, K) quantized stack from E quantized 2-d weights of one format (same layout, block size, shapes,
    activation spec). ``name`` names the Parameter in errors. See Note [Expert weights]."""
    if not weights:
        raise ValueError(f"{name}: no experts to stack")
    first = weights[0]
    attrs = first.attributes()
    for e, w in enumerate(weights):
        problem = _stack_problem(first, w)
        if problem is not None:
            raise ValueError(f"{name}: expert {e} can't share one quantized stack with expert 0: {problem}")
    tensors = {n: None if t is None else torch.stack([w.inner_tensors()[n] for w in weights])
               for n, t in first.inner_tensors().items()}
    attrs.update(block_size=(1, *first.block_size), logical_shape=(len(weights), *first.logical_shape))
    return type(first)(tensors, **attrs)


def _stack_problem(first, w) -> str | None:
    if w.is_experts or w.transposed:
        return "each expert must be an untransposed 2-d quantized weight"
    if w.attributes() != first.attributes():
        diff = [k for k, v in w.attributes().items() if first.attributes()[k] != v]
        return f"their formats differ in {diff}"
    for n, t in w.inner_tensors().items():
        u = first.inner_tensors().get(n)
        if (t is None) != (u is None) or (t is not None and (t.shape != u.shape or t.dtype != u.dtype)):
            return f"inner tensor {n} differs in presence, shape or dtype"
    return None
