"""Ops torch.distributed calls on a quantized expert stack (E, N, K) sharded along its expert dim.

See Note [Expert-parallel shards]. Registered on the expert stacks' op table (tensor/dispatch.py's EXPERT_OPS);
the collectives and receive buffers are the 2-d weights' own (shard_ops.py), which work on inner tensors of any
rank.

Note [Expert-parallel shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``distribute_tensor(stack, mesh, [Shard(0)])`` chunks the stack with ``aten.split`` along dim 0, then (unless
``src_data_rank=None``) allocates a receive buffer with ``empty_like`` and scatters the chunks with
``c10d::scatter_``, once per inner tensor. Every layout stores a stack as its per-expert packed tensors stacked
along a leading dim (Note [Expert weights]), so a chunk of whole experts is ``t[start:end]`` of every inner
tensor: a contiguous view, whatever the layout, and a rank's shard is an ordinary (E / world, N, K) stack that
``w[e]``, ``w[ids]``, ``torch._grouped_mm`` and ``torch.bmm`` serve as they serve any stack. What can't be a
shard is refused before anything is sent, with the way out:
- a cut along N or K (``Shard(1)`` / ``Shard(2)``): every expert would be cut, which is tensor parallelism
  inside the experts; no MoE code here runs on such pieces;
- chunks of unequal size (E not a multiple of the world size): DTensor would pad the last chunk, and packed
  storage has no padding value; ``new_zeros`` of an empty chunk (more ranks than experts) is refused likewise.
"""
from __future__ import annotations

import torch

from ..tensor.dispatch import EXPERT_OPS, fill_defaults
from ..tensor.experts import expert_range
from .shard_ops import ShardingError, _broadcast, _empty_like, _scatter, _view

aten = torch.ops.aten
c10d = torch.ops.c10d

__all__: list[str] = []

EXPERT_OPS.implements(aten.empty_like.default)(_empty_like)
EXPERT_OPS.implements(c10d.scatter_.default)(_scatter)
EXPERT_OPS.implements(c10d.broadcast_.default)(_broadcast)
EXPERT_OPS.implements(aten.view.default)(_view)


def _check_split(w, dim: int, sizes: list[int]) -> None:
    """ShardingError unless ``w`` (an expert stack) is cut along its expert dim into equal pieces."""
    experts = w.shape[0]
    if dim % 3 != 0:
        raise ShardingError(
            f"can't shard a quantized expert stack {tuple(w.shape)} ({w.qlayout!r}) along dim {dim % 3}: a stack "
            f"shards along its expert dim only (Shard(0), each rank holding whole experts: "
            f"torchqkit.parallelize_experts_); a cut along dim {dim % 3} would split every expert's "
            f"{'N' if dim % 3 == (2 if w.transposed else 1) else 'K'}. Use Shard(0), or keep this Parameter "
            f"replicated.")
    if len(set(sizes)) > 1:
        raise ShardingError(
            f"can't shard a quantized expert stack of {experts} experts {tuple(w.shape)} ({w.qlayout!r}) into "
            f"pieces of {sizes}: every rank must hold the same number of whole experts (packed storage can't be "
            f"padded), so the number of experts must be a multiple of the world size. Use a world size that divides "
            f"{experts}.")


def _pieces(w, dim: int, sizes: list[int]) -> list:
    _check_split(w, dim, sizes)
    out, start = [], 0
    for n in sizes:
        out.append(expert_range(w, start, start + n))
        start += n
    return out


@EXPERT_OPS.implements(aten.split.Tensor)
def _split(func, args, kwargs):
    w, split_size, dim = fill_defaults(args, 3, [0])
    size = w.shape[dim % 3]
    sizes = [min(split_size, size - s) for s in range(0, size, split_size)] if size else [0]
    return _pieces(w, dim, sizes)


@EXPERT_OPS.implements(aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    w, sizes, dim = fill_defaults(args, 3, [0])
    return _pieces(w, dim, list(sizes))


@EXPERT_OPS.implements(aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    """DTensor asks for an empty chunk when there are more ranks than chunks (E not a multiple of the world size,
    e.g. 6 experts over 4 ranks chunk as 2 + 2 + 2 + 0): refused with the reason."""
    w, size = args[0], tuple(args[1])
    raise ShardingError(
        f"new_zeros{size} of a quantized expert stack {tuple(w.shape)}: an empty or padded shard. Every rank must "
        f"hold the same number of whole experts, so the number of experts ({w.shape[0]}) must be a multiple of "
        f"the world size.")
