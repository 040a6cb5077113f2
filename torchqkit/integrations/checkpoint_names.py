"""Where transformers' ``save_pretrained`` puts each tensor of a model, fused expert Parameters split per expert.

Note [Checkpoint names of fused experts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5.x fuses a MoE layer's per-expert Linears when it loads a checkpoint (its conversion mapping:
Qwen3-MoE's ``mlp.experts.{e}.gate_proj.weight`` and ``up_proj.weight`` become rows [0, I) and [I, 2I) of
``mlp.experts.gate_up_proj[e]``; Mixtral's ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` likewise, its
``block_sparse_moe`` renamed ``mlp``) and reverts that when it saves. vLLM and SGLang read the per-expert form.
A quantized stack can't go through transformers' own revert (its ops cat and chunk float tensors), so the names
are found by running that revert on probes: every tensor is replaced by integers numbering its rows (shape
(..., N, 1); a 1-d tensor numbers its elements), each tensor's numbers distinct. What comes out says, for every
saved key, which rows of which tensor it holds: a renamed tensor holds all of its own rows in order; a piece of an
expert Parameter holds one expert's consecutive rows [start, end) of N (a fused gate / up split, or a whole
expert). Anything else (rows of several tensors or experts, reordered or transposed rows) is a conversion this
mapping can't express for packed codes, and is refused naming the key. transformers' revert is used as it is, so
the names are what ``model.save_pretrained`` writes for a float model of the same class.
"""
from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch

__all__ = ["ExpertPiece", "CheckpointNames", "checkpoint_names"]


class ExpertPiece(NamedTuple):
    """Rows [start, end) of expert ``expert``'s (N, K) weight, saved as the Linear ``module`` (its ``.weight``)."""
    module: str
    expert: int
    start: int
    end: int


class CheckpointNames(NamedTuple):
    renames: dict[str, str]                  # model state-dict key -> saved key, for every other tensor
    pieces: dict[str, list[ExpertPiece]]     # expert Parameter name -> its pieces, by expert then rows


def checkpoint_names(model, shapes: dict[str, tuple], experts: set[str]) -> CheckpointNames:
    """The saved names of the tensors ``shapes`` (model state-dict key -> shape) of the transformers model
    ``model``; the keys in ``experts`` are (E, N, K) expert Parameters. ValueError for a conversion that is more
    than renames and per-expert row ranges. See Note [Checkpoint names of fused experts]."""
    from transformers.core_model_loading import revert_weight_conversion
    probes, starts, keys = {}, [], []
    offset = 0
    for key, shape in shapes.items():
        shape = tuple(shape)
        pshape = (*shape[:-1], 1) if len(shape) >= 2 else shape
        n = math.prod(pshape)
        probes[key] = torch.arange(offset, offset + n, dtype=torch.int64).reshape(pshape)
        starts.append(offset)
        keys.append(key)
        offset += max(n, 1)
    what = f"transformers' save conversion of {type(model).__name__}"
    try:
        saved = revert_weight_conversion(model, dict(probes))
    except Exception as e:  # its ops on our probes: anything it can't do to them is a conversion we can't map
        raise ValueError(f"{what} can't be followed for quantized tensors ({type(e).__name__}: {e})") from None
    renames, pieces, covered = {}, {}, set()
    for name, t in saved.items():
        t = t[0] if isinstance(t, list) else t
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise ValueError(f"{what} turns saved tensor {name} into something other than rows of the model's "
                             f"tensors")
        if t.numel() == 0:  # no row to trace it by: an empty tensor keeps its name (checked below)
            continue
        flat = t.reshape(-1)
        i = bisect.bisect_right(starts, int(flat[0])) - 1
        key, local = keys[i], flat - starts[i]
        probe = probes[key]
        if key not in experts:
            if tuple(t.shape) != tuple(probe.shape) or not torch.equal(local, torch.arange(probe.numel())):
                raise ValueError(f"{what} saves {name} as a transformed part of {key} (not a rename); torchqkit "
                                 f"can't write packed codes that way")
            renames[key] = name
            covered.add(key)
            continue
        if t.dim() == 3:
            raise ValueError(f"{what} keeps {key} fused, as one 3-d tensor {name}: this model type's checkpoints "
                             f"have no per-expert Linears to write its experts as")
        e, n = int(local[0]) // probe.shape[1], probe.shape[1]
        start = int(local[0]) % n
        rows = torch.arange(start, start + flat.numel())
        if (t.dim() != 2 or t.shape[1] != 1 or not name.endswith(".weight") or start + flat.numel() > n
                or not torch.equal(local, e * n + rows)):
            raise ValueError(f"{what} saves {name} from {key} as something other than consecutive rows of one expert "
                             f"(a Linear weight); torchqkit can't write packed codes that way")
        pieces.setdefault(key, []).append(ExpertPiece(name.removesuffix(".weight"), e, start, start + flat.numel()))
    for key in shapes:
        if key in experts:
            _check_cover(key, pieces.get(key, []), shapes[key], what)
        elif key not in covered and probes[key].numel() == 0 and key in saved:
            renames[key] = key
        elif key not in covered:
            raise ValueError(f"{what} doesn't save {key}")
    return CheckpointNames(renames, {k: sorted(v, key=lambda p: (p.expert, p.start)) for k, v in pieces.items()})


def _check_cover(key: str, pieces: list[ExpertPiece], shape, what: str) -> None:
    experts, n = shape[0], shape[1]
    got = sorted((p.expert, p.start, p.end) for p in pieces)
    for e in range(experts):
        mine = [(s, t) for x, s, t in got if x == e]
        ends = [0] + [t for _, t in mine]
        if not mine or [s for s, _ in mine] != ends[:-1] or ends[-1] != n:
            raise ValueError(f"{what} doesn't save every row of expert {e} of {key} exactly once")
