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

from ..algorithms.observers import static_activation_scale
from ..algorithms.smoothquant import smoothing_scales
from ..tensor.experts import stack_experts
from .awq_experts import ObservedBlock, calibrated_modules, install_stack
from .block_edits import Undo
from .calibrate_experts import expert_calibration_note
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
    def fold_target_problem(found):
        down = found.get("down_proj")
        if down is not None and smoothing_strength(down[2]) is not None and "gate_up_proj" not in found:
            return (f"SmoothQuant of {down[0]} folds its scales into gate_up_proj's up rows before those are "
                    f"quantized: give gate_up_proj a SmoothQuant or static-activation config too, or down_proj "
                    f"one without smoothing (smoothing=None)")
        return None
    for found in calibrated_modules(targets, plan, "SmoothQuant", fold_target_problem):
        _smooth_module(block, prefix, found, inputs, plan, undo, total, max_rows)


def _smooth_module(block, prefix, found, inputs, plan, undo: Undo, total: int, max_rows: int) -> None:
    module = next(iter(found.values()))[1].module
    seen = ObservedBlock(block, module, inputs, total, max_rows, down="down_proj" in found)
    stats = seen.stats
    notes = {attr: [] for attr in found}
    smooth: dict[str, dict[int, torch.Tensor]] = {attr: {} for attr in found}
    gate_up = found.get("gate_up_proj")
    if gate_up is not None and smoothing_strength(gate_up[2]) is not None and stats.all is not None:
        fqn, p, config = gate_up
        alpha = smoothing_strength(config)
        s = smoothing_scales(stats.all.absmax, list(module.gate_up_proj.detach().unbind(0)), alpha)
        folded = seen.fold_shared(prefix, p, s, undo, "smoothquant")
        if isinstance(folded, str):
            notes["gate_up_proj"].append(folded)
        else:
            smooth["gate_up_proj"] = {e: s for e in range(stats.count)}
            notes["gate_up_proj"].append(f"smoothquant alpha {alpha:g}: scales shared by the {stats.count} experts, "
                                         f"folded into {folded[0]} and the router {folded[1]}")
    down = found.get("down_proj")
    if down is not None and smoothing_strength(down[2]) is not None and stats.h:
        alpha = smoothing_strength(down[2])
        weight = module.down_proj.detach()
        scales = {e: smoothing_scales(stats.h[e].absmax, [weight[e]], alpha) for e in sorted(stats.h)}
        if seen.fold_down(module, scales, undo):
            smooth["down_proj"] = scales
            notes["down_proj"].append(f"smoothquant alpha {alpha:g}: scales per expert folded into each expert's "
                                      f"gate_up_proj up rows")
        else:
            notes["down_proj"].append("smoothquant: down_proj not smoothed (folding into gate_up_proj's up rows "
                                      "changed the block's output)")
    for attr, (fqn, p, config) in found.items():
        x_stats = stats.x if attr == "gate_up_proj" else stats.h
        install_stack(plan, undo, module, attr, fqn, notes[attr],
                      lambda: _quantize(fqn, getattr(module, attr).detach(), config, x_stats, smooth[attr],
                                        stats.count))


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
        ranges = {e: static_activation_scale(base, x_stats[e], smooth.get(e), weight[e]) for e in sorted(x_stats)}
        top = max(ranges, key=lambda e: ranges[e][0])
        r, scale = ranges[top]
        base = dataclasses.replace(base, act_scale=scale)
        extra = (f"; static activation scale {scale:.4g} ({base.observer} range {r:.4g}, the largest of the "
                 f"experts' ranges: expert {top}'s)")
    handler = handler_for(base)
    stack = stack_experts([handler(base, weight[e], f"{fqn}[{e}]") for e in range(count)], fqn)
    rows = [x_stats[e].rows for e in sorted(x_stats)]
    method = "smoothquant" if isinstance(config, SmoothQuantConfig) else "static activation scales"
    without = ("no smoothing of their own" if smoothing_strength(config) is not None and fqn.endswith("down_proj")
               else "quantized as the others") + (", under the stack's static scale" if extra else "")
    return stack, expert_calibration_note(method, rows, missing, count, fqn, without) + extra
