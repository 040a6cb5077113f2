"""Expert stacks in a compressed-tensors checkpoint: one Linear per expert (and per gate / up half), as vLLM and
SGLang read mixture-of-experts models.

Note [Expert stacks in compressed-tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
compressed-tensors describes Linears only. A quantized (E, N, K) stack is written as the Linears transformers'
``save_pretrained`` would split it into (Note [Checkpoint names of fused experts]): for Qwen3-MoE / OLMoE
``mlp.experts.{e}.gate_proj`` (rows [0, I) of ``gate_up_proj[e]``), ``up_proj`` (rows [I, 2I)) and
``down_proj``; for Mixtral ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``. Each piece is a row slice of one
expert's 2-d quantized view (the layout's own slice: whole rows of codes, scales and zero points, which every
per-row or per-group format has), written in its exact compressed-tensors form like any Linear: codes and scales
bit for bit. The config lists them by one ``re:`` target per experts module and piece
(``re:^model\\.layers\\.0\\.mlp\\.experts\\.\\d+\\.gate_proj$``), not one name per expert (a 128-expert, 48-layer
model would list 18k names); a target naming the experts is also how transformers' compressed-tensors loader finds
the experts' config group. Float stacks are split the same way, as float ``.weight`` tensors, and named in
``ignore``. Importing reverses it (hub_import.py): the pieces of each expert are decoded, joined along N and
stacked, so the stack comes back with the same codes.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch

from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from ..tensor.experts import expert_view
from .checkpoint_names import ExpertPiece
from .compressed_tensors_schemes import ct_scheme

__all__ = ["PieceExport", "plan_expert_pieces", "piece_targets"]


class PieceExport(NamedTuple):
    """One saved Linear of an expert Parameter: its name, its weight (2-d quantized or float) and scheme (None:
    float)."""
    module: str
    weight: torch.Tensor
    scheme: object


def plan_expert_pieces(fqn: str, stack: torch.Tensor, pieces: list[ExpertPiece]) -> tuple[list[PieceExport], list]:
    """(the pieces to write, refusals) for the expert Parameter ``fqn``; a refusal names the piece and the reason."""
    if not isinstance(stack, AffineQuantizedTensor):
        return [PieceExport(p.module, stack.detach()[p.expert, p.start:p.end], None) for p in pieces], []
    if stack.transposed:
        return [], [f"{fqn} ({stack.qdtype.name}, {stack.qlayout!r}): a transposed expert stack (E, K, N); "
                    f"compressed-tensors stores Linears (N, K)"]
    out, refused = [], []
    for p in pieces:
        expert = expert_view(stack, p.expert)
        try:
            w = expert if (p.start, p.end) == (0, expert.shape[0]) else expert[p.start:p.end]
        except (ValueError, NotImplementedError, IndexError) as e:  # the layout's cut rules
            refused.append((p, str(e)))
            continue
        scheme = ct_scheme(w)
        if isinstance(scheme, str):
            refused.append((p, scheme))
        else:
            out.append(PieceExport(p.module, w, scheme))
    if refused:  # one line per expert Parameter: its experts share one format, so usually one reason for all
        p, why = refused[0]
        more = f" ({len(refused) - 1} more of its {len(pieces)} Linears likewise)" if len(refused) > 1 else ""
        return [], [f"{fqn} ({stack.qdtype.name}, block_size {stack.block_size}, zero point "
                    f"{stack.zero_point_domain.value}, {stack.qlayout!r}) as {p.module} (rows [{p.start}, {p.end}) "
                    f"of expert {p.expert}): {why}{more}"]
    return out, []


def piece_targets(pieces: list[PieceExport]) -> list[tuple[str, object]]:
    """(target, scheme) for the pieces of one expert Parameter: one ``re:`` target per piece position when the names
    differ only by the expert number, else each name."""
    by_slot: dict[str, list[PieceExport]] = {}
    for p in pieces:
        by_slot.setdefault(_slot_key(p.module), []).append(p)
    out = []
    for slot in by_slot.values():
        pattern = _pattern([p.module for p in slot])
        schemes = {p.scheme.key() if p.scheme is not None else None for p in slot}
        if pattern is not None and len(schemes) == 1:
            out.append((pattern, slot[0].scheme))
        else:
            out.extend((p.module, p.scheme) for p in slot)
    return out


def _slot_key(module: str):
    """The name with its numbers blanked: pieces of one position in every expert share it."""
    return re.sub(r"\.\d+\.", ".#.", module)


def _pattern(names: list[str]) -> str | None:
    """``re:`` target matching exactly ``names`` (one dot-separated part differs, the expert number), or None."""
    parts = [n.split(".") for n in names]
    if len(names) < 2 or len({len(p) for p in parts}) != 1:
        return None
    differ = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    if len(differ) != 1 or not all(p[differ[0]].isdigit() for p in parts):
        return None
    i = differ[0]
    head, tail = ".".join(parts[0][:i]), ".".join(parts[0][i + 1:])
    return f"re:^{re.escape(head)}\\.\\d+\\.{re.escape(tail)}$"
