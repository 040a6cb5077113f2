"""SmoothQuant and static activation scales for mixture-of-experts expert Parameters, inside quantize_'s
block-by-block calibration.

Note [SmoothQuant and static activation scales of expert Parameters]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The statistics come as AWQ's do (Note [AWQ of expert Parameters], awq_experts.py): a forward pre-hook on the experts
module sees the hidden rows routed to each expert, and act_fn(gate) * up of them.

- Smoothing (a ``SmoothQuantConfig``, or a static config's own ``smoothing``), folded as AWQ folds its scales:
  ``gate_up_proj``'s experts all read the norm's output, so they share one s = max|x|^alpha / max|w|^(1 - alpha)
  (max|x| over every hidden row, max|w| over every expert's columns), with 1 / s folded into the norm and s into
  every expert's columns and the float router's; ``down_proj``'s expert e gets its own s_e from its routed rows,
  folded into the up rows of ``gate_up_proj[e]`` (so ``down_proj`` is smoothed only with ``gate_up_proj`` given the
  same kind of config). Both folds are checked to leave the float block's output unchanged.
- A static activation scale (``Int8StaticActivationInt8WeightConfig`` / ``Float8StaticActivationFloat8WeightConfig``
  without ``act_scale``): a stack of experts has one activation format, so one scale per stack. Each expert's range
  is observed on its own routed rows (after its smoothing) by the config's observer, and the stack takes the largest,
  as inference engines do with per-expert input scales of a fused MoE layer (vLLM takes the maximum over experts).
  An expert that got no calibration token is covered by the others' range and named in the report; a stack none of
  whose experts got a token is refused.

Every expert is then quantized with the base config (and the stack's scale) and the stack built as usual. The same
structures as GPTQ's and AWQ's are known (Qwen3-MoE, Mixtral, OLMoE: gate_up_proj / down_proj with an act_fn,
untransposed, no biases).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..algorithms.blockwise import run_block
from ..algorithms.observers import static_range
from ..algorithms.smoothquant import smoothing_scales
from ..core.granularity import PerTensor
from ..core.qdtype import int8
from ..tensor.activation import ActivationQuantSpec
from ..tensor.experts import stack_experts
from .awq_experts import ExpertStats, expert_router, first_output, input_norm
from .block_edits import Undo, block_output, fold_scales, is_norm, same_function
from .calibrate_experts import expert_calibration_note, structure_problem
from .configs.base import handler_for
from .configs.calibrated import SmoothQuantConfig
from .expert_weights import ExpertParameter
from .quantize_weight import UnsupportedWeight

__all__ = ["smooth_experts", "smoothing_strength"]


def smoothing_strength(config) -> float | None:
    """SmoothQuant's alpha for ``config`` (the wrapper's, else a static config's ``smoothing``), None: no smoothing."""
    if isinstance(config, SmoothQuantConfig):
        return config.alpha
    return getattr(config, "smoothing", None)


def _base(config):
    return config.base if isinstance(config, SmoothQuantConfig) else config


def smooth_experts(block: nn.Module, prefix: str, targets: dict[str, tuple[ExpertParameter, object]], inputs,
                   plan, undo: Undo, total: int, max_rows: int) -> None:
    """Smooth and / or observe static activation scales for the expert Parameters ``targets`` of one block, whose
    ``inputs`` hold ``total`` token rows; see Note [SmoothQuant and static activation scales of expert Parameters].
    Results go into ``plan`` (stack or UnsupportedWeight, and a note) and are installed through ``undo``."""
    by_module: dict[int, dict[str, tuple[str, ExpertParameter, object]]] = {}
    for fqn, (p, config) in targets.items():
        by_module.setdefault(id(p.module), {})[p.attr] = (fqn, p, config)
    for found in by_module.values():
        problem = next((structure_problem(p, "SmoothQuant") for _, p, _ in found.values()
                        if structure_problem(p, "SmoothQuant")), None)
        down = found.get("down_proj")
        if problem is None and down is not None and smoothing_strength(down[2]) is not None \
                and "gate_up_proj" not in found:
            problem = (f"SmoothQuant of {down[0]} folds its scales into gate_up_proj's up rows before those are "
                       f"quantized: give gate_up_proj a SmoothQuant or static-activation config too, or down_proj "
                       f"one without smoothing (smoothing=None)")
        if problem is not None:
            for fqn, _, _ in found.values():
                plan.weights[fqn] = UnsupportedWeight(problem)
            continue
        _smooth_module(block, prefix, found, inputs, plan, undo, total, max_rows)


def _smooth_module(block, prefix, found, inputs, plan, undo: Undo, total: int, max_rows: int) -> None:
    module = next(iter(found.values()))[1].module
    stats = ExpertStats(module, total, max_rows, down="down_proj" in found)
    outputs: dict[str, torch.Tensor] = {}
    norms = {n: m for n, m in block.named_modules() if is_norm(m)}
    handles = [module.register_forward_pre_hook(stats.hook, with_kwargs=True)]
    handles += [m.register_forward_hook(first_output(outputs, n)) for n, m in norms.items()]
    try:
        run_block(block, inputs)
    finally:
        for h in handles:
            h.remove()
    reference = block_output(block, inputs[0])
    unchanged = lambda: same_function(block_output(block, inputs[0]), reference)  # noqa: E731
    notes = {attr: [] for attr in found}
    smooth: dict[str, dict[int, torch.Tensor]] = {attr: {} for attr in found}
    if "gate_up_proj" in found and smoothing_strength(found["gate_up_proj"][2]) is not None:
        s = _shared_smoothing(block, prefix, found["gate_up_proj"], stats, outputs, norms, undo, unchanged,
                              notes["gate_up_proj"])
        if s is not None:
            smooth["gate_up_proj"] = {e: s for e in range(stats.count)}
    if "down_proj" in found and smoothing_strength(found["down_proj"][2]) is not None:
        smooth["down_proj"] = _down_smoothing(found["down_proj"], stats, undo, unchanged, notes["down_proj"])
    for attr, (fqn, p, config) in found.items():
        x_stats = stats.x if attr == "gate_up_proj" else stats.h
        try:
            stack, note = _quantize(fqn, getattr(module, attr).detach(), config, x_stats, smooth[attr], stats.count)
        except UnsupportedWeight as e:
            plan.weights[fqn] = e
            continue
        plan.weights[fqn] = stack
        plan.notes[fqn] = "; ".join([*notes[attr], note])
        undo.set(module, attr, stack)


def _shared_smoothing(block, prefix, target, stats: ExpertStats, outputs, norms, undo, unchanged, notes):
    """gate_up_proj's smoothing scales, shared by the experts, folded into the norm and the router; None when not
    applied."""
    fqn, p, config = target
    module = p.module
    weight = module.gate_up_proj.detach()
    alpha = smoothing_strength(config)
    if stats.all is None:
        return None
    norm = input_norm(outputs, stats.first)
    router = expert_router(block, prefix, p)
    where = f"{prefix}.{norm}" if prefix and norm else norm
    if norm is None or router is None:
        what = "no norm produces their input" if norm is None else "no float router weight next to them"
        notes.append(f"smoothquant: gate_up_proj not smoothed ({what} to fold the shared scales into)")
        return None
    s = smoothing_scales(stats.all.absmax, list(weight.unbind(0)), alpha)
    mine = Undo()
    fold_scales(norms[norm], s, mine)
    name, r = router
    mine.set(r, "weight", (r.weight.detach().float() * s).to(r.weight.dtype))
    mine.set(module, "gate_up_proj", (weight.float() * s).to(weight.dtype))
    if not unchanged():  # another reader of the norm (a shared expert) would see x / s
        mine.restore()
        notes.append(f"smoothquant: gate_up_proj not smoothed (folding 1/s into {where} would change the block: its "
                     f"output feeds more than the experts and the router)")
        return None
    undo.adopt(mine)
    notes.append(f"smoothquant alpha {alpha:g}: scales shared by the {stats.count} experts, folded into {where} and "
                 f"the router {name}")
    return s


def _down_smoothing(target, stats: ExpertStats, undo, unchanged, notes) -> dict[int, torch.Tensor]:
    """Each expert's down_proj smoothing scales s_e, folded into its gate_up_proj up rows; {} when not applied."""
    fqn, p, config = target
    module = p.module
    alpha = smoothing_strength(config)
    down, gate_up = module.down_proj.detach(), module.gate_up_proj.detach()
    half = gate_up.shape[1] // 2
    scales = {}
    new_down, new_gate_up = down.float().clone(), gate_up.float().clone()
    for e in sorted(stats.h):
        s = smoothing_scales(stats.h[e].absmax, [down[e]], alpha)
        scales[e] = s
        new_down[e] *= s
        new_gate_up[e, half:] /= s.unsqueeze(1)  # up's rows: act_fn(gate) * up / s
    if not scales:
        return {}
    mine = Undo()
    mine.set(module, "down_proj", new_down.to(down.dtype))
    mine.set(module, "gate_up_proj", new_gate_up.to(gate_up.dtype))
    if not unchanged():
        mine.restore()
        notes.append("smoothquant: down_proj not smoothed (folding into gate_up_proj's up rows changed the block's "
                     "output)")
        return {}
    undo.adopt(mine)
    notes.append(f"smoothquant alpha {alpha:g}: scales per expert folded into each expert's gate_up_proj up rows")
    return scales


def _quantize(fqn: str, weight: torch.Tensor, config, x_stats: dict, smooth: dict, count: int):
    """(stack, note): every expert quantized with the base config, under the stack's static activation scale when
    the base observes one (the largest of the experts' ranges)."""
    base = _base(config)
    missing = [e for e in range(count) if e not in x_stats]
    extra = ""
    if base.needs_calibration_data():
        if not x_stats:
            raise UnsupportedWeight(f"no calibration token reached any expert of {fqn}: a static activation scale "
                                    f"needs some; calibrate with more data, or give {fqn} a dynamic-activation "
                                    f"config")
        qdtype = getattr(base, "activation_dtype", int8)
        qmax = float(qdtype.qmax)

        def fake_quantize(x, r):
            return ActivationQuantSpec(qdtype, PerTensor(), static_scale=max(r, 1e-12) / qmax).fake_quantize(x)

        ranges = {e: static_range(x_stats[e], base.observer, base.percentile, smooth.get(e),
                                  fake_quantize=fake_quantize, weight=weight[e]) for e in sorted(x_stats)}
        top = max(ranges, key=ranges.get)
        r = max(ranges[top], 1e-12)
        base = dataclasses.replace(base, act_scale=r / qmax)
        extra = (f"; static activation scale {r / qmax:.4g} ({base.observer} range {r:.4g}, the largest of the "
                 f"experts' ranges: expert {top}'s)")
    handler = handler_for(base)
    stack = stack_experts([handler(base, weight[e], f"{fqn}[{e}]") for e in range(count)], fqn)
    rows = [x_stats[e].rows for e in sorted(x_stats)]
    method = "smoothquant" if isinstance(config, SmoothQuantConfig) else "static activation scales"
    without = ("no smoothing of their own" if smoothing_strength(config) is not None and fqn.endswith("down_proj")
               else "quantized as the others") + (", under the stack's static scale" if extra else "")
    return stack, expert_calibration_note(method, rows, missing, count, fqn, without) + extra
