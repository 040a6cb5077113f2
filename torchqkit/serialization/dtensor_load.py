"""Loading into a tensor-parallel model: each rank reads only its own shard of every tensor.

A model parallelized on the meta device (``parallelize_module`` with ColwiseParallel / RowwiseParallel) holds
DTensor parameters with this rank's placement. For each of them ``load_quantized`` reads the rank's part of
the stored tensor instead of the whole. For a quantized weight the part is found by cutting a meta-device copy
of the weight with its layout's own slice (whole blocks, tiles, bytes; an illegal cut raises before the model
is touched): every inner tensor of the cut is then a narrow of the stored one along one dim, and exactly
those bytes are read. A layout whose shard is computed rather than viewed (NF4 double quantization cut inside
a group of 256 absmax values) has its small absmax tensors read whole and cut in memory; that is said in a
warning. The result is a DTensor whose local tensor is an AffineQuantizedTensor, as ``distribute_tensor``
would have made from the whole weight.
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .entries import INNER_SEP
from .safetensors_file import CheckpointError

__all__ = ["ShardPlan", "plan_shards", "read_shard", "holds_quantized"]

aten = torch.ops.aten


class ShardPlan(NamedTuple):
    target: DTensor                        # the model's parameter / buffer (global shape, placements)
    cut: tuple[int, int, int] | None       # (dim, start, length) of this rank, None when replicated
    shard: AffineQuantizedTensor | None    # a quantized weight's shard on the meta device (its attributes)
    whole: AffineQuantizedTensor | None    # the weight it was cut from, on the meta device


def holds_quantized(t: torch.Tensor) -> bool:
    return isinstance(t.to_local() if isinstance(t, DTensor) else t, AffineQuantizedTensor)


def _local_cut(path, name: str, target: DTensor) -> tuple[int, int, int] | None:
    """(dim, start, length) of this rank's part of ``target`` (torch.chunk's split, as distribute_tensor cuts),
    or None when it is replicated."""
    mesh, placements = target.device_mesh, target.placements
    if mesh.ndim != 1 or type(placements[0]) not in (Shard, Replicate):  # exact types: _StridedShard is a Shard
        raise CheckpointError(f"{path}: tensor {name!r} is a DTensor with placements {placements} on a {mesh.ndim}-d "
                              f"mesh; load_quantized reads shards for one mesh dim with Shard(dim) or Replicate() "
                              f"(tensor parallelism). Load before applying other placements.")
    if isinstance(placements[0], Replicate):
        return None
    dim = placements[0].dim % target.dim()
    size, world, rank = target.shape[dim], mesh.size(0), mesh.get_coordinate()[0]
    chunk = -(-size // world)
    start = min(size, rank * chunk)
    return dim, start, max(0, min(chunk, size - start))


# Note [Finding a shard in the file]
# Each stored inner tensor gets a meta stand-in that starts at its own storage offset (a multiple of 2^40
# elements; meta tensors allocate nothing). A layout's slice returns either narrows of these (same strides, the
# offset moved into the stand-in's range: exactly a range of the file) or tensors it computed (offset 0, not a
# range of anything stored). Offsets tell the two apart without relying on view tracking, which does not
# record bases for views made inside __torch_dispatch__.
_OFFSET_STEP = 1 << 40


def _meta_weight(ckpt, name: str) -> AffineQuantizedTensor:
    attrs = ckpt.weights[name]
    tensors = dict.fromkeys(attrs["qlayout"].tensor_names)
    for i, inner in enumerate(ckpt.inner[name]):
        stored = f"{name}{INNER_SEP}{inner}"
        reader = ckpt.readers[ckpt.where[stored]]
        shape, offset = reader.shape(stored), (i + 1) * _OFFSET_STEP
        flat = torch.empty(offset + math.prod(shape), dtype=reader.dtype(stored), device="meta")
        tensors[inner] = flat.narrow(0, offset, math.prod(shape)).view(shape)
    return AffineQuantizedTensor(tensors, **attrs)


def plan_shards(ckpt, expected: dict) -> dict[str, ShardPlan]:
    """What each DTensor entry of the model reads; every cut is checked here, before anything is loaded."""
    plans = {}
    for name, target in expected.items():
        if not isinstance(target, DTensor):
            continue
        stored_name = ckpt.tied.get(name, name)
        cut = _local_cut(ckpt.path, name, target)
        shard = whole = None
        if stored_name in ckpt.weights:
            shard = whole = _meta_weight(ckpt, stored_name)
            if cut is not None:
                dim, start, length = cut
                try:
                    shard = aten.slice.Tensor(whole, dim, start, start + length)  # the layout's cut rules
                except ValueError as e:
                    raise CheckpointError(f"{ckpt.path}: quantized weight {name!r} can't be cut for this rank "
                                          f"(dim {dim}, [{start}:{start + length}]): {e}") from None
        plans[name] = ShardPlan(target, cut, shard, whole)
    return plans


def read_shard(ckpt, name: str, plan: ShardPlan) -> DTensor:
    """This rank's part of stored tensor ``name``, as a DTensor with the model's placements."""
    if plan.shard is None:
        reader = ckpt.readers[ckpt.where[name]]
        local = reader.read(name) if plan.cut is None else reader.read_narrow(name, *plan.cut)
    else:
        local = _read_quantized_shard(ckpt, name, plan)
        problem = local.qparams_problem()
        if problem is not None:
            raise CheckpointError(f"{ckpt.path}: quantized weight {name!r} (this rank's shard {plan.cut}): {problem}: "
                                  f"the file is corrupt or was not written by a quantizer")
    target = plan.target
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                              shape=target.shape, stride=target.stride())


def _read_quantized_shard(ckpt, name: str, plan: ShardPlan) -> AffineQuantizedTensor:
    full = plan.whole
    parts = {n: t for n, t in plan.shard.inner_tensors().items() if t is not None}
    narrows = {n: _as_narrow(t, getattr(full, n)) for n, t in parts.items()}
    stored = {n: f"{name}{INNER_SEP}{n}" for n in full.inner_tensors()}
    read = {n: ckpt.readers[ckpt.where[stored[n]]] for n, t in full.inner_tensors().items() if t is not None}
    computed = [n for n, cut in narrows.items() if cut is None]
    if computed:
        # The shard's values are computed from the whole weight's (see the module docstring): cut it in memory.
        warnings.warn(f"load_quantized: {name}: this rank's {computed} of {plan.shard.qlayout!r} (cut {plan.cut}) are "
                      f"computed from the whole weight, not a range of the file: read it whole and cut it in memory",
                      stacklevel=3)
        real = full.with_changes({n: r.read(stored[n]) for n, r in read.items()})
        dim, start, length = plan.cut
        return aten.slice.Tensor(real, dim, start, start + length).map_tensors(torch.clone)
    tensors = {n: (read[n].read_narrow(stored[n], *narrows[n]) if n in parts else None)
               for n in dict.fromkeys((*plan.shard.qlayout.tensor_names, *parts))}  # + an input_scale, each read once
    return AffineQuantizedTensor(tensors, **plan.shard.attributes())


def _as_narrow(part: torch.Tensor, base: torch.Tensor | None) -> tuple[int, int, int] | None:
    """(dim, start, length) when meta tensor ``part`` is ``base.narrow(dim, start, length)``, else None (see
    Note [Finding a shard in the file])."""
    if base is None or base.dim() == 0 or part.stride() != base.stride() or part.dtype != base.dtype:
        return None
    rel = part.storage_offset() - base.storage_offset()
    if not 0 <= rel < max(base.numel(), 1) + (part.numel() == 0):
        return None
    diff = [d for d in range(base.dim()) if part.shape[d] != base.shape[d]]
    if len(diff) > 1:
        return None
    dim = diff[0] if diff else 0
    if rel % base.stride(dim):
        return None
    return dim, rel // base.stride(dim), part.shape[dim]
