"""Expert Parameters read from per-expert Linears (how vLLM-style MoE checkpoints store them): one expert's pieces
joined along N into one weight, before the experts are stacked (Note [Expert stacks in compressed-tensors]).

A checkpoint stores expert e of ``gate_up_proj`` as two Linears (``experts.{e}.gate_proj``: rows [0, I), and
``up_proj``: rows [I, 2I)), each with its own codes, scales and zero points along its rows. With per-row scales
(every per-channel or per-group format: block_size (1, g)) the expert's weight is the two pieces' rows one after
the other, codes and scales alike; a per-tensor scale joins only when the pieces share it. The layouts' own
tensors a checkpoint may hold as they are (NVFP4) join the same way: a tensor with one row per weight row is
concatenated, anything else (a global scale) must be the same in every piece.
"""
from __future__ import annotations

import torch

from .hub_formats import DecodedWeight

__all__ = ["join_rows"]


def join_rows(parts: list[DecodedWeight], rows: list[int], where: str) -> DecodedWeight:
    """One (sum(rows), K) weight from pieces of ``rows`` rows each, in order; ValueError naming ``where`` for pieces
    that can't share one weight's format."""
    first = parts[0]
    if len(parts) == 1:
        return first
    same = ("qdtype", "block_size", "act_quant", "dtype")
    for d in parts[1:]:
        diff = [f for f in same if getattr(d, f) != getattr(first, f)]
        if diff or (d.zero_point is None) != (first.zero_point is None) or (d.stored is None) != (first.stored is None):
            raise ValueError(f"{where}: its Linears differ in {diff or ['zero points / stored layout']}; one expert's "
                             f"weight is stored in one format")
    if any(d.g_idx is not None for d in parts):
        raise ValueError(f"{where}: act-order (g_idx) expert Linears are not joined into one expert weight")
    n = sum(rows)
    block = first.block_size
    if block[0] != 1:  # one scale for a whole piece: the pieces must share it
        if any(d.block_size[0] != r for d, r in zip(parts, rows)) or \
                any(not torch.equal(d.scale, first.scale) for d in parts):
            raise ValueError(f"{where}: its Linears have different per-tensor scales (block_size {block}); torchqkit "
                             f"stores one scale per expert weight for that format")
        block, scale = (n, block[1]), first.scale
        zp = first.zero_point
    else:
        scale = torch.cat([d.scale for d in parts])
        zp = None if first.zero_point is None else torch.cat([d.zero_point for d in parts])
    stored = None
    if first.stored is not None:
        tensors = {}
        for name, t in first.stored[1].items():
            pieces = [d.stored[1][name] for d in parts]
            if all(p.dim() >= 1 and p.shape[0] == r for p, r in zip(pieces, rows)):
                tensors[name] = torch.cat(pieces).contiguous()
            elif all(torch.equal(p, t) for p in pieces):
                tensors[name] = t
            else:
                raise ValueError(f"{where}: its Linears store different {name} tensors; torchqkit stores one per "
                                 f"expert weight")
        stored = (first.stored[0], tensors)
    return first._replace(codes=torch.cat([d.codes for d in parts]), scale=scale, zero_point=zp, block_size=block,
                          stored=stored)
