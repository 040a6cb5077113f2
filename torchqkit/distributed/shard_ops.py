"""Ops that let torch.distributed shard, scatter and broadcast a quantized weight as packed storage.

See Note [Sharding quantized weights]. Registered on the generic op table, so every layout gets them; the
cuts themselves go through each layout's own ``aten.slice`` (whole blocks, tiles and bytes, always views).

Note [Sharding quantized weights]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``distribute_tensor`` (what ``ColwiseParallel`` / ``RowwiseParallel`` call) chunks the weight with
``aten.split`` along N (dim 0) or K (dim 1), then, unless ``src_data_rank=None``, allocates a receive buffer
with ``empty_like`` and scatters the shards from one rank with ``c10d::scatter_``. A quantized shard is an
AffineQuantizedTensor whose inner tensors (codes, scales, zero points) are the matching views of the
original's, so:
- a cut is legal only where the layout can slice: whole blocks, tiles, bytes (``cut_multiple``); any other
  cut raises an error naming the layout, the dim and the legal multiples, before anything is sent;
- a collective on a quantized tensor runs once per inner tensor (the packed bytes, never dequantized
  floats), and every shard must store the same inner tensors with the same shapes (an NF4 double-quantized
  weight cut inside a group of 256 absmax values keeps its absmax in float32 instead: shards then differ,
  and the scatter names ``src_data_rank=None`` as the way out).
FSDP2 (``fully_shard``) cuts along dim 0 with the same ``aten.split`` and keeps its padded shard with
``new_zeros`` + ``narrow`` + ``copy_``, ``view(-1)`` and ``as_strided`` (identity uses only, below); what it
all-gathers comes from ``fsdp_pre_all_gather`` (Note [FSDP2 all-gather of packed storage], tensor/fsdp.py).
"""
from __future__ import annotations

import warnings

import torch

from ..layouts.slicing import cut_multiple
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from ..tensor.dispatch import GENERIC_OPS, fill_defaults
from ..tensor.fsdp import collective_form
from ..layouts.aliasing import return_view

aten = torch.ops.aten
c10d = torch.ops.c10d

__all__ = ["ShardingError", "shard_multiple"]


class ShardingError(ValueError):
    """A quantized weight can't be cut where torch.distributed asked: the cut would split a block or storage tile.

    Raised while ``distribute_tensor`` (tensor parallelism: ``ColwiseParallel`` / ``RowwiseParallel``) or FSDP2
    splits an ``AffineQuantizedTensor``, before anything is sent; the message names the layout, the dimension and
    the legal multiples (``shard_multiple``). Choose a world size that divides the weight into whole blocks, or
    leave the layer out of the parallelize plan. A ``ValueError``.

    Example:
        ```python
        import torchqkit as qk
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        try:
            parallelize_module(model, mesh, {"layers.0.mlp.up_proj": ColwiseParallel()})
        except qk.ShardingError as e:
            print("can't shard:", e)
        ```
    """


def shard_multiple(w: AffineQuantizedTensor, dim: int) -> int:
    """The multiple at which shards of a quantized weight along ``dim`` must start (and end, except the last).

    A cut is legal only where the layout can slice its packed storage: whole blocks, tiles and bytes. Use it to
    pick a world size (or shard sizes) before sharding a quantized model.

    Args:
        w (AffineQuantizedTensor): the quantized weight.
        dim (int): the (outer) dimension to cut along; negative values count from the end. A transposed view's
            dimensions are mapped to the stored weight's.

    Returns:
        int: the multiple, e.g. 1 along either dimension of a per-row ``PlainLayout`` weight, 8 rows and 128
            columns for a ``TensorCoreTiledLayout`` weight with group size 128.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(256, 256), qk.qdtypes.uint4, qk.PerGroup(128), qk.TensorCoreTiledLayout(),
                               mapping="asymmetric", zero_point_domain="float")
        print(qk.shard_multiple(w, 0), qk.shard_multiple(w, 1))     # 8 128
        ```
    """
    dim = dim % w.dim()
    return cut_multiple(w, (w.dim() - 1 - dim) if w.transposed else dim)


def _dim_name(w: AffineQuantizedTensor, dim: int) -> str:
    sdim = (w.dim() - 1 - dim) if w.transposed else dim
    return {0: "out_features (N)", 1: "in_features (K)"}.get(sdim, f"dim {sdim}") if w.dim() == 2 else f"dim {dim}"


def _check_cuts(w: AffineQuantizedTensor, dim: int, sizes: list[int]) -> None:
    m, size = shard_multiple(w, dim), w.shape[dim]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    bad = [s for s in starts[1:] if s % m and s != size]
    if bad:
        raise ShardingError(
            f"can't shard a quantized weight {tuple(w.shape)} with layout {w.qlayout!r} along dim {dim} "
            f"({_dim_name(w, dim)}) into pieces of {sizes}: the cut at {bad[0]} splits a block or storage tile. "
            f"{type(w.qlayout).__name__} with block_size {w.block_size} cuts dim {dim} only at multiples of {m} "
            f"({size} = {size // m} x {m}{f' + {size % m}' if size % m else ''}); choose a world size that divides "
            f"{-(-size // m)} evenly, or leave this layer unsharded (not in the parallelize plan).")


def _pieces(w: AffineQuantizedTensor, dim: int, sizes: list[int]) -> list[AffineQuantizedTensor]:
    _check_cuts(w, dim, sizes)
    if len(sizes) > 1:
        _warn_dynamic_activation_split(w, dim)
    out, start = [], 0
    for n in sizes:
        out.append(aten.slice.Tensor(w, dim, start, start + n))  # the layout's own slice: views of the storage
        start += n
    for piece in out[1:]:
        # Checked here, identically on every rank, rather than in a collective: a rank that raised there would
        # leave the others waiting in it.
        _same_storage(out[0], piece, f"splitting {tuple(w.shape)} along dim {dim} into {sizes}")
    return out


def _warn_dynamic_activation_split(w: AffineQuantizedTensor, dim: int) -> None:
    """A K shard of a weight with dynamic activation quantization quantizes each token's slice of K against that
    slice's own range (the scale is computed where the activation is, on each rank): the result differs from
    one process by quantization noise. Said once, not hidden."""
    spec = w.act_quant
    sdim = (w.dim() - 1 - dim) if w.transposed else dim
    if spec is not None and spec.static_scale is None and w.dim() == 2 and sdim == 1:
        warnings.warn(
            f"sharding a weight with dynamic activation quantization ({spec}) along in_features (K, e.g. "
            f"RowwiseParallel): each rank computes the activation scales over its own part of K, so outputs differ "
            f"from the single-process model by quantization noise (not bit-for-bit up to summation order as for "
            f"weight-only layouts). Shard such layers along out_features (ColwiseParallel) to keep them equal.",
            stacklevel=2)


@GENERIC_OPS.implements(aten.split.Tensor)
def _split(func, args, kwargs):
    w, split_size, dim = fill_defaults(args, 3, [0])
    dim = dim % w.dim()
    size = w.shape[dim]
    sizes = [min(split_size, size - s) for s in range(0, size, split_size)] if size else [0]
    return _pieces(w, dim, sizes)


@GENERIC_OPS.implements(aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    w, sizes, dim = fill_defaults(args, 3, [0])
    return _pieces(w, dim % w.dim(), list(sizes))


@GENERIC_OPS.implements(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    """A receive buffer of the same format (collectives fill it inner tensor by inner tensor)."""
    w = args[0]
    device = kwargs.get("device")
    # Contiguous whatever the source's strides: collectives write dense buffers.
    return w.map_tensors(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device or t.device))


# ------------------------------------------------------------------------------------------------
# collectives: once per inner tensor, see Note [Sharding quantized weights]
# ------------------------------------------------------------------------------------------------

def _same_storage(a: AffineQuantizedTensor, b: AffineQuantizedTensor, what: str) -> None:
    sa = {n: None if t is None else (tuple(t.shape), t.dtype) for n, t in a.inner_tensors().items()}
    sb = {n: None if t is None else (tuple(t.shape), t.dtype) for n, t in b.inner_tensors().items()}
    if type(a.qlayout) is not type(b.qlayout) or sa != sb:
        raise ShardingError(
            f"{what}: the shards of a quantized weight would store different inner tensors ({a.qlayout!r}: {sa} "
            f"vs {b.qlayout!r}: {sb}); collectives (scatter, FSDP2's all-gather) send each inner tensor as it is, so "
            f"they must match. This happens when a cut keeps some shards' compressed scales and not others' (NF4 "
            f"double quantization cut inside a group of 256 absmax values: a shard of rows must hold a multiple of "
            f"256 blocks). Quantize with NF4WeightOnlyConfig(double_quant=False), or pick a world size whose shards "
            f"hold whole groups.")


def _inner_names(w: AffineQuantizedTensor) -> list[str]:
    return [n for n, t in w.inner_tensors().items() if t is not None]


def _check_dense(tensors, what: str) -> None:
    for w in tensors:
        bad = [n for n, t in w.inner_tensors().items() if t is not None and not t.is_contiguous()]
        if bad:
            raise ValueError(f"{what} into a quantized tensor whose inner tensors {bad} are strided views (e.g. a "
                             f"slice along in_features): receive into a buffer made with torch.empty_like(w) or "
                             f"w.clone(); weight: {w!r}")


def _run_each(calls):
    """Issue one collective per inner tensor; all but the last are waited on here, the last Work goes back to
    the caller (which waits on it, or not, as it would for a plain tensor)."""
    work = None
    for call in calls:
        if work is not None:
            work.wait()
        _, work = call()
    return work


@GENERIC_OPS.implements(c10d.scatter_.default)
def _scatter(func, args, kwargs):
    outputs, inputs, *rest = args
    for out in outputs:
        for piece in (p for group in inputs for p in group):
            _same_storage(out, piece, "scatter")
    _check_dense(outputs, "scatter")
    # A shard along K is a strided view of the codes and scales: send dense copies.
    work = _run_each(lambda n=n: func([collective_form(getattr(o, n)) for o in outputs],
                                      [[collective_form(getattr(p, n).contiguous()) for p in g] for g in inputs],
                                      *rest, **kwargs)
                     for n in _inner_names(outputs[0]))
    return outputs, work


@GENERIC_OPS.implements(c10d.broadcast_.default)
def _broadcast(func, args, kwargs):
    tensors, *rest = args
    _check_dense(tensors, "broadcast")
    work = _run_each(lambda n=n: func([collective_form(getattr(t, n)) for t in tensors], *rest, **kwargs)
                     for n in _inner_names(tensors[0]))
    return tensors, work


@GENERIC_OPS.implements(aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    """A zero-filled weight of ``size`` rows in the format a row shard of ``w`` has: FSDP2 allocates its padded
    shard with it and copies the real shard in (``narrow`` + ``copy_``)."""
    w, size = args[0], tuple(args[1])
    if w.dim() != 2 or w.transposed or size[1:] != tuple(w.shape[1:]) or size[0] > w.shape[0]:
        raise NotImplementedError(f"new_zeros{size} of a quantized weight {tuple(w.shape)}: only a block of its own "
                                  f"rows (what FSDP2 allocates for a shard) is supported")
    rows = aten.slice.Tensor(w, 0, 0, size[0])  # the layout's cut rules apply
    return rows.map_tensors(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=kwargs.get("device") or t.device))


@GENERIC_OPS.implements(aten.view.default)
def _view(func, args, kwargs):
    """The identity view (DTensor wraps and unwraps local tensors with ``x.view_as(x)``), and ``view(-1)``.

    A quantized weight has no flat view of its elements (codes, scales and zero points are separate tensors).
    FSDP2 keeps ``shard.view(-1)`` as a handle on the shard's storage but never reads it when the tensor has
    ``fsdp_pre_all_gather`` (it all-gathers what that returns): ``view(-1)`` returns an alias of the whole
    weight, same shape, so nothing can read it as flat elements by mistake."""
    w, shape = args[0], tuple(args[1])
    if shape != tuple(w.shape) and shape != (-1,):
        raise NotImplementedError(f"view{shape} of a quantized weight {tuple(w.shape)}: only a view of the same shape "
                                  f"(an alias) is supported; call .dequantize() first to reshape the values")
    return return_view(func, args, kwargs, lambda: w.map_tensors(aten.alias.default))


@GENERIC_OPS.implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    """Only the identity (same size, contiguous strides, offset 0): FSDP2 passes the rebuilt weight through it."""
    w, size, stride, offset = fill_defaults(args, 4, [0])
    if tuple(size) != tuple(w.shape) or tuple(stride) != tuple(w.stride()) or offset:
        raise NotImplementedError(f"as_strided({tuple(size)}, {tuple(stride)}, {offset}) of a quantized weight "
                                  f"{tuple(w.shape)}: only the identity is supported; call .dequantize() first")
    return return_view(func, args, kwargs, lambda: w.map_tensors(aten.alias.default))
