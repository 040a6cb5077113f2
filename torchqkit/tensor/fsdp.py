"""FSDP2 all-gather extension: ``fully_shard`` gathers a quantized weight's packed storage, never floats.

See Note [FSDP2 all-gather of packed storage]. ``AffineQuantizedTensor.fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` (the extension points FSDP2 looks for on a parameter's local tensor) call these.

Note [FSDP2 all-gather of packed storage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FSDP2 shards every parameter along dim 0 (out_features): each rank keeps rows [r N / W, (r + 1) N / W) as an
AffineQuantizedTensor (the layout's own slice: whole n-tiles, blocks). Before a forward it all-gathers the
tensors ``fsdp_pre_all_gather`` returns, concatenating the ranks' pieces along their dim 0, and hands the
results to ``fsdp_post_all_gather``, which rebuilds the whole weight. So:
- each inner tensor is sent with its row dim first: the dim where the shard's shape differs from the shape
  the layout stores for the whole weight (``packed_specs``); e.g. the tiled int4 ``scale_and_zero`` is
  [groups][N8][2] and travels as [N8][groups][2] (a dense copy, moved back after the gather);
- an inner tensor the shards share (an NF4 double-quantization offset, a single per-tensor scale) is not
  gathered: the local one is the whole one;
- float8 codes travel as their bytes (the collective has no float8 types);
- only weights quantized per row along N (block_size[0] == 1, what every weight-only config and NF4 do) can be
  rebuilt from row shards; anything else is refused when the first all-gather runs, with the reason.
The gathered tensors are the rebuilt weight's storage (a view where the row dim is already first), so FSDP2
frees and refills them between steps without another copy.
"""
from __future__ import annotations

import torch

__all__ = ["pre_all_gather", "post_all_gather", "collective_form"]


def _row_dim(name: str, local: torch.Tensor, full_shape: tuple[int, ...], w) -> int | None:
    """The dim along which rank shards of ``local`` concatenate into ``full_shape``; None if shared."""
    diff = [d for d, (a, b) in enumerate(zip(local.shape, full_shape)) if a != b]
    if len(local.shape) != len(full_shape) or len(diff) > 1:
        raise NotImplementedError(f"FSDP2 can't rebuild inner tensor {name} {tuple(local.shape)} of {w!r} from row "
                                  f"shards: the whole weight stores it as {full_shape}")
    return diff[0] if diff else None


def collective_form(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a collective can send it: float8 codes travel as their bytes (gloo has no float8 types)."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def pre_all_gather(w, outer_size, world: int | None = None) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """(tensors to all-gather, metadata) for the local row shard ``w`` of a weight of ``outer_size``, one of
    ``world`` equal shards."""
    if world is not None and w.shape[0] * world != outer_size[0]:
        raise NotImplementedError(
            f"FSDP2 over {world} ranks: {int(outer_size[0])} rows don't split evenly ({w.shape[0]} on this rank); a "
            f"quantized weight's shards must all hold the same number of rows (its packed storage can't be padded "
            f"like a float tensor). Use a world size that divides out_features, or keep this layer out of "
            f"fully_shard. (weight shard: {w!r})")
    if w.transposed or w.dim() != 2 or w.block_size[0] != 1:
        raise NotImplementedError(
            f"FSDP2 shards weights by rows and rebuilds them from the ranks' pieces; {w!r} has block_size "
            f"{w.block_size}: its scales span several rows. Quantize per row along out_features (every weight-only "
            f"config's default) or keep this layer out of fully_shard.")
    full_shape = (int(outer_size[0]), int(outer_size[1]))
    specs = w.qlayout.packed_specs(w.weight_format._replace(shape=full_shape))
    gathered, plan, shared = [], [], {}
    for name, t in w.inner_tensors().items():
        if t is None:
            continue
        d = _row_dim(name, t, specs[name].shape, w) if name in specs else None
        if d is None:
            shared[name] = t
            continue
        gathered.append(collective_form(t.movedim(d, 0).contiguous()))
        plan.append((name, d, t.dtype))
    return tuple(gathered), (tuple(plan), shared, full_shape)


def post_all_gather(w, outputs, metadata, param_dtype, out=None):
    """The whole weight (an AffineQuantizedTensor) from the gathered tensors, and the tensors FSDP2 frees
    and refills between steps. ``out``: the weight returned the first time, refilled in place."""
    plan, shared, full_shape = metadata
    tensors = {n: None for n in w.qlayout.tensor_names}
    tensors.update(shared)
    storage = []
    for (name, d, dtype), g in zip(plan, outputs):
        g = g.view(dtype) if g.dtype != dtype else g
        storage.append(g)
        tensors[name] = g if d == 0 else g.movedim(0, d).contiguous()
    if out is not None:
        for (name, d, _), g in zip(plan, storage):
            if d != 0:  # a rebuilt copy, not the gathered buffer itself: refill it
                # Through .data, as FSDP2's own collective writes into the gathered buffers: the backward may
                # hold this tensor from the forward, and the values written are the same ones.
                getattr(out, name).data.copy_(g.movedim(0, d))
        return None
    whole = w.with_changes(tensors, logical_shape=full_shape)
    # FSDP2 frees and refills these between steps: the gathered buffers and the copies made from them.
    inner = tuple(dict.fromkeys([*storage, *(whole.inner_tensors()[n] for n, d, _ in plan if d != 0)]))
    return whole, inner
