"""AWQ for mixture-of-experts expert Parameters, inside quantize_'s block-by-block calibration.

Note [AWQ of expert Parameters]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
AWQ scales a weight's input channels by s (x W^T = (x / s)(W s)^T) and folds 1 / s into the op that produces x
(algorithms/awq.py). An experts module gets its statistics as GPTQ's does (Note [Expert calibration]): a forward
pre-hook sees each call's hidden states and the router's choices, so every expert e has its own routed rows.

- ``gate_up_proj``: its input is the norm's output that every expert and the router read. Scales per expert can't
  be folded into that one norm, so the experts share one s: searched (s = mean|x|^r) for the smallest output error
  summed over the experts, each expert on its own routed rows; 1 / s folds into the norm, s into every expert's
  columns and into the router's columns (the router computes the same logits, and stays float). An expert that
  got no tokens counts for nothing in the search and still has its columns scaled (the norm's fold applies to
  every expert).
- ``down_proj``: expert e's input is act_fn(gate) * up of its own rows, linear in up: its own s_e folds into the
  up rows of ``gate_up_proj[e]`` (before that is quantized), so each expert gets its own scales, from its rows.
- Clipping (``clip=True``) searches each expert's clipping on its own routed rows (scaled as above).

Both folds are checked: the float block's output must not change (another reader of the norm, such as a shared
expert, would see x / s: the scales are then not applied, and the report says so). Every expert is then quantized
with the base config and the stack built as usual. An expert that got no calibration token has no statistics: no
s_e, no clipping, round-to-nearest of its (shared-scaled) weight, named in the report. ``down_proj`` is calibrated
by AWQ only together with its module's ``gate_up_proj`` (its fold target); the same structures as GPTQ's are known
(Qwen3-MoE, Mixtral, OLMoE: gate_up_proj / down_proj with an act_fn, untransposed, no biases).

Memory: about ``CalibrationData.max_rows`` sampled rows per expert of each input (hidden H and intermediate I
features, float32), for one experts module at a time: E x max_rows x (H + I) x 4 bytes (Qwen3-30B-A3B with the
default 1024 rows: 128 x 1024 x 2816 x 4 = 1.4 GiB), freed before the next block.
"""
from __future__ import annotations

import torch
from torch import nn

from ..algorithms.awq import CLIP_ROWS, awq_clip, awq_scales
from ..algorithms.blockwise import run_block
from ..algorithms.observers import InputStats
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from ..tensor.experts import stack_experts
from .block_edits import Undo, block_output, fold_scales, is_norm, same_function
from .calibrate_experts import (expert_calibration_note, expert_intermediate, routed_rows, routing,
                                structure_problem)
from .calibration_grid import ConfigGrid
from .configs.base import handler_for
from .expert_weights import ROUTER_NAMES, ExpertParameter
from .quantize_weight import UnsupportedWeight

__all__ = ["awq_experts", "calibrated_modules", "install_stack", "ExpertStats", "ObservedBlock", "expert_router",
           "first_output", "input_norm"]


def awq_experts(block: nn.Module, prefix: str, targets: dict[str, tuple[ExpertParameter, object]], inputs, plan,
                undo: Undo, total: int, max_rows: int) -> None:
    """AWQ the expert Parameters ``targets`` (AWQConfig ones) of one block, whose ``inputs`` hold ``total`` token
    rows; see Note [AWQ of expert Parameters]. Results go into ``plan`` (stack or UnsupportedWeight, and a note) and
    are installed through ``undo``; at most ``max_rows`` rows are sampled per expert."""
    def fold_target_problem(found):
        if "down_proj" in found and "gate_up_proj" not in found:
            return (f"AWQ of {found['down_proj'][0]} folds its scales into gate_up_proj's up rows before those are "
                    f"quantized: give gate_up_proj the same AWQConfig, or down_proj a weight-only config")
        return None
    for found in calibrated_modules(targets, plan, "AWQ", fold_target_problem):
        _awq_module(block, prefix, found, inputs, plan, undo, total, max_rows)


def calibrated_modules(targets: dict[str, tuple[ExpertParameter, object]], plan, method: str, problem_of):
    """The experts modules of ``targets`` as {attr: (fqn, ExpertParameter, config)}, one per module, but those
    ``method`` can't calibrate (their structure, or ``problem_of(found)``: a str) whose Parameters are refused in
    ``plan`` with the reason."""
    by_module: dict[int, dict[str, tuple[str, ExpertParameter, object]]] = {}
    for fqn, (p, config) in targets.items():
        by_module.setdefault(id(p.module), {})[p.attr] = (fqn, p, config)
    usable = []
    for found in by_module.values():
        problem = next((structure_problem(p, method) for _, p, _ in found.values() if structure_problem(p, method)),
                       None) or problem_of(found)
        if problem is None:
            usable.append(found)
        for fqn, _, _ in found.values() if problem is not None else ():
            plan.weights[fqn] = UnsupportedWeight(problem)
    return usable


class ExpertStats:
    """Per-expert statistics of one experts module's inputs, filled by a forward pre-hook: the hidden rows routed to
    each expert (gate_up_proj's input) and, when asked, act_fn(gate) * up of them (down_proj's input)."""

    def __init__(self, module: nn.Module, total: int, max_rows: int, down: bool):
        self.module, self.down = module, down
        self.count = module.gate_up_proj.shape[0]
        self.total, self.max_rows = total, max_rows
        self.all = None          # every hidden row: the shared scales' mean |x|
        self.first = None        # the first call's hidden states: which norm produced them
        self.x: dict[int, InputStats] = {}
        self.h: dict[int, InputStats] = {}

    def hook(self, module, args, kwargs):
        hidden, index = routing(args, kwargs)
        x = hidden.detach().reshape(-1, hidden.shape[-1]).float()
        if self.first is None:
            self.first = hidden.detach()
        if self.all is None:
            self.all = InputStats(x.shape[-1], self.total, max_rows=1)
        self.all.add(x)
        top_k = index.reshape(x.shape[0], -1).shape[-1]
        with torch.no_grad():
            for e, rows in routed_rows(x, index, self.count):
                expected = max(1, self.total * top_k // self.count)  # an expert's share of the rows
                self._stats(self.x, e, rows.shape[-1], expected).add(rows)
                if self.down:
                    h = expert_intermediate(module, e, rows)
                    self._stats(self.h, e, h.shape[-1], expected).add(h)

    def _stats(self, table, e, k, expected) -> InputStats:
        if e not in table:  # sampling about max_rows of the rows this expert is expected to get
            table[e] = InputStats(k, expected, max_rows=self.max_rows, seed=e)
        return table[e]


class ObservedBlock:
    """One pass of ``block`` over ``inputs`` with an experts ``module`` observed: its routed statistics (``stats``,
    ExpertStats), each norm's first output (``outputs``, to find the one feeding the experts), and ``unchanged()``:
    whether the block still computes what it computed then (the check every fold must pass)."""

    def __init__(self, block, module, inputs, total: int, max_rows: int, down: bool):
        self.stats = ExpertStats(module, total, max_rows, down)
        self.outputs: dict[str, torch.Tensor] = {}
        self.norms = {n: m for n, m in block.named_modules() if is_norm(m)}
        handles = [module.register_forward_pre_hook(self.stats.hook, with_kwargs=True)]
        handles += [m.register_forward_hook(first_output(self.outputs, n)) for n, m in self.norms.items()]
        try:
            run_block(block, inputs)
        finally:
            for h in handles:
                h.remove()
        self.block, self.first_input = block, inputs[0]
        self.reference = block_output(block, inputs[0])

    def unchanged(self) -> bool:
        return same_function(block_output(self.block, self.first_input), self.reference)

    def fold_shared(self, prefix, p, s: torch.Tensor, undo: Undo, method: str) -> tuple[str, str] | str:
        """Fold gate_up_proj's input scales s (shared by the experts): 1 / s into the norm producing the experts'
        input, s into every expert's columns and the float router's. (norm fqn, router fqn), or why not (nothing
        changed then)."""
        module = p.module
        norm = input_norm(self.outputs, self.stats.first)
        router = expert_router(self.block, prefix, p)
        if norm is None or router is None:
            what = "no norm produces their input" if norm is None else "no float router weight next to them"
            return f"{method}: gate_up_proj not scaled ({what} to fold the shared scales into)"
        where = f"{prefix}.{norm}" if prefix else norm
        weight = module.gate_up_proj.detach()
        mine = Undo()
        fold_scales(self.norms[norm], s, mine)
        name, r = router
        mine.set(r, "weight", (r.weight.detach().float() * s).to(r.weight.dtype))
        mine.set(module, "gate_up_proj", (weight.float() * s).to(weight.dtype))
        if not self.unchanged():  # another reader of the norm (a shared expert) would see x / s
            mine.restore()
            return (f"{method}: gate_up_proj not scaled (folding 1/s into {where} would change the block: its output "
                    f"feeds more than the experts and the router)")
        undo.adopt(mine)
        return where, name

    def fold_down(self, module, scales: dict[int, torch.Tensor], undo: Undo) -> bool:
        """Fold each expert's down_proj input scales s_e: down_proj[e]'s columns times s_e, the up rows of its
        gate_up_proj divided by it (act_fn(gate) * up / s_e). False (nothing changed) when the block's output moved."""
        down, gate_up = module.down_proj.detach(), module.gate_up_proj.detach()
        half = gate_up.shape[1] // 2
        new_down, new_gate_up = down.float().clone(), gate_up.float().clone()
        for e, s in scales.items():
            new_down[e] *= s
            new_gate_up[e, half:] /= s.unsqueeze(1)
        mine = Undo()
        mine.set(module, "down_proj", new_down.to(down.dtype))
        mine.set(module, "gate_up_proj", new_gate_up.to(gate_up.dtype))
        if not self.unchanged():
            mine.restore()
            return False
        undo.adopt(mine)
        return True


def _awq_module(block, prefix, found, inputs, plan, undo: Undo, total: int, max_rows: int) -> None:
    _, p, config = found["gate_up_proj"]
    module = p.module
    seen = ObservedBlock(block, module, inputs, total, max_rows, down="down_proj" in found)
    stats = seen.stats
    notes = {attr: [] for attr in found}
    shared = _shared_scales(seen, prefix, p, config, undo, notes["gate_up_proj"])
    own = _down_scales(seen, found["down_proj"], undo, notes["down_proj"]) if "down_proj" in found else {}
    for attr, (fqn, p_attr, cfg) in found.items():
        x_stats = stats.x if attr == "gate_up_proj" else stats.h
        scales = {e: shared for e in x_stats} if attr == "gate_up_proj" else own
        install_stack(plan, undo, module, attr, fqn, notes[attr],
                      lambda: _quantize(fqn, getattr(module, attr).detach(), cfg, x_stats, scales, stats.count))


def input_norm(outputs: dict, first: torch.Tensor) -> str | None:
    """The name of the norm whose first output (``outputs``, by first_output hooks) is the experts' first input."""
    return next((n for n, y in outputs.items() if y.numel() == first.numel() and torch.equal(y.reshape(first.shape),
                                                                                              first)), None)


def install_stack(plan, undo: Undo, module, attr: str, fqn: str, notes: list[str], build) -> None:
    """``build()`` -> (stack, note) installed as ``module.attr`` through ``undo``, with the notes, in ``plan``; or the
    UnsupportedWeight it raises, recorded in ``plan``."""
    try:
        stack, note = build()
    except UnsupportedWeight as e:
        plan.weights[fqn] = e
        return
    plan.weights[fqn] = stack
    plan.notes[fqn] = "; ".join([*notes, note])
    undo.set(module, attr, stack)


def first_output(store, name):
    def hook(module, args, out):
        if isinstance(out, torch.Tensor):
            store.setdefault(name, out.detach())
    return hook


def _shared_scales(seen: ObservedBlock, prefix, p, config, undo, notes):
    """gate_up_proj's scales, shared by the experts, folded into the norm and the router; None when not applied."""
    stats = seen.stats
    weight = p.module.gate_up_proj.detach()
    with_tokens = sorted(stats.x)
    if not with_tokens:
        return None
    grids = [ConfigGrid(config.base, weight[e], f"{p.fqn}[{e}]") for e in with_tokens]
    s, ratio = awq_scales([stats.x[e].sample() for e in with_tokens], stats.all.mean_abs,
                          [weight[e] for e in with_tokens], [g.fake_quantize for g in grids], config.n_grid)
    folded = seen.fold_shared(prefix, p, s, undo, "awq")
    if isinstance(folded, str):
        notes.append(folded)
        return None
    where, name = folded
    notes.append(f"awq: scales mean|x|^{ratio:.2f} shared by the {stats.count} experts, folded into {where} and the "
                 f"router {name}")
    return s


def expert_router(block, prefix, p):
    """(name, module) of the float router next to the experts module, whose weight (E, H) takes the scales."""
    parent = p.module_fqn.rpartition(".")[0]
    local = parent[len(prefix) + 1:] if prefix else parent
    mods = dict(block.named_modules())
    for n in ROUTER_NAMES:
        r = mods.get(f"{local}.{n}" if local else n)
        w = getattr(r, "weight", None)
        if isinstance(w, torch.Tensor) and not isinstance(w, AffineQuantizedTensor) and w.dim() == 2 \
                and w.shape[1] == p.module.gate_up_proj.shape[-1]:
            return (f"{parent}.{n}" if parent else n), r
    return None


def _down_scales(seen: ObservedBlock, target, undo, notes) -> dict[int, torch.Tensor]:
    """Each expert's down_proj scales s_e, folded into its gate_up_proj up rows; {} when not applied."""
    fqn, p, config = target
    stats = seen.stats
    down = p.module.down_proj.detach()
    scales, ratios = {}, []
    for e in sorted(stats.h):
        grid = ConfigGrid(config.base, down[e], f"{fqn}[{e}]")
        scales[e], ratio = awq_scales([stats.h[e].sample()], stats.h[e].mean_abs, [down[e]], [grid.fake_quantize],
                                      config.n_grid)
        ratios.append(ratio)
    if not scales:
        return {}
    if not seen.fold_down(p.module, scales, undo):
        notes.append("awq: down_proj not scaled (folding into gate_up_proj's up rows changed the block's output)")
        return {}
    notes.append(f"awq: scales per expert (mean|h|^{min(ratios):.2f} to ^{max(ratios):.2f}) folded into each "
                 f"expert's gate_up_proj up rows")
    return scales


def _quantize(fqn: str, weight: torch.Tensor, config, x_stats: dict, scales: dict, count: int):
    """(stack, note): each expert clipped on its routed rows (when ``config.clip``) and quantized with the base
    config; round-to-nearest for experts without tokens."""
    handler = handler_for(config.base)
    experts, missing = [], []
    for e in range(count):
        name = f"{fqn}[{e}]"
        w = weight[e]
        stats = x_stats.get(e)
        if stats is None:
            missing.append(e)
        elif config.clip:
            grid = ConfigGrid(config.base, w, name)  # raises UnsupportedWeight naming the expert
            s = scales.get(e)
            x = stats.sample()[:CLIP_ROWS] / (s if s is not None else 1.0)
            w = awq_clip(x, w, grid.fake_quantize, grid.group_size, config.n_grid).to(w.dtype)
        experts.append(handler(config.base, w, name))
    rows = [x_stats[e].rows for e in sorted(x_stats)]
    return stack_experts(experts, fqn), expert_calibration_note("awq", rows, missing, count, fqn)
