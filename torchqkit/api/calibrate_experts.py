"""GPTQ for mixture-of-experts expert Parameters, inside quantize_'s block-by-block calibration.

Note [Expert calibration]
~~~~~~~~~~~~~~~~~~~~~~~~~
An experts module (Note [Expert Parameters in quantize_], expert_weights.py) is called as ``experts(hidden_states
(T, H), top_k_index (T, k), top_k_weights (T, k))``, whatever experts implementation transformers runs ("eager",
"grouped_mm", ...). A forward pre-hook on it sees exactly which token rows go to which expert, so for each expert
e it accumulates the Hessian of the inputs that expert's weights multiply:

- ``gate_up_proj[e]`` (2I, H): the hidden-state rows routed to e;
- ``down_proj[e]`` (H, I): ``act_fn(gate) * up`` of those rows, with ``gate, up = (x @ gate_up_proj[e]^T)``
  split in two halves, computed from the module's current ``gate_up_proj``.

A token that picks e is counted once, unweighted by its routing weight (what GPTQ tooling for MoE models does).
The two Parameters are calibrated in order: ``gate_up_proj`` first, then ``down_proj``'s statistics come from a
second pass of the block with the quantized ``gate_up_proj`` in place (as GPTQ does for gate / up, then down).

Each expert's codes come from the ordinary GPTQ solver (algorithms/gptq.py) with that expert's Hessian and the
config's grid for that expert's weight; the E results are stacked (stack_experts). An expert no calibration token
reached has no Hessian: it is rounded to nearest in the same format, and the report entry names it.

Memory: one float32 K x K Hessian per expert that got tokens, for the one Parameter being calibrated (E H^2 x 4
bytes for gate_up_proj, E I^2 x 4 for down_proj), freed before the next; nothing is kept per token.

Only the gate_up_proj / down_proj experts with an ``act_fn`` and no biases, stored untransposed (Qwen3-MoE,
Mixtral, OLMoE, ...), are calibrated: another structure (gpt-oss: transposed, biased, its own clamped gating)
computes down_proj's inputs differently, and is reported as skipped with the reason.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..algorithms.blockwise import run_block
from ..algorithms.gptq import HessianAccumulator, gptq_codes
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from ..tensor.experts import stack_experts
from .calibration_grid import ConfigGrid
from .configs.base import handler_for
from .configs.calibrated import AWQConfig, GPTQConfig, SmoothQuantConfig
from .expert_weights import ROUTER_NAMES, ExpertParameter, expert_parameters, is_experts_module
from .quantize_weight import UnsupportedWeight

__all__ = ["expert_targets", "takes_static_or_smoothing", "router_fqns", "calibrate_experts", "structure_problem",
           "routing",
           "expert_intermediate"]

# calibrated in this order within a block: down_proj's inputs depend on gate_up_proj
_ORDER = ("gate_up_proj", "down_proj")


def expert_targets(modules: dict[str, nn.Module], configs, expert_filter) -> dict[str, tuple[ExpertParameter, object]]:
    """Expert Parameters whose config calibrates on data: GPTQConfig, AWQConfig (Note [AWQ of expert Parameters],
    awq_experts.py), SmoothQuantConfig or a static activation config without its scale (Note [SmoothQuant and static
    activation scales of expert Parameters], smoothquant_experts.py); others that need data stay refused by
    expert_weights."""
    exact = set(configs.exact_keys())
    found = {}
    for p in expert_parameters(modules):
        if expert_filter is not None and p.fqn not in exact and not expert_filter(p.module, p.fqn):
            continue
        config = configs.lookup(p.fqn)[1]
        if isinstance(config, (GPTQConfig, AWQConfig)) or takes_static_or_smoothing(config):
            found[p.fqn] = (p, config)
    return found


def takes_static_or_smoothing(config) -> bool:
    """Whether this module calibrates an expert Parameter under ``config``: SmoothQuant, or a static activation
    scale to observe."""
    return isinstance(config, SmoothQuantConfig) or (config is not None and config.needs_calibration_data()
                                                     and hasattr(config, "act_scale"))


def router_fqns(modules: dict[str, nn.Module], exact: set) -> set[str]:
    """Routers next to experts modules that ModuleConfigs doesn't name: they stay float, so calibration must leave
    them float too (a router quantized during calibration would route the later blocks' tokens differently)."""
    found = set()
    for fqn, module in modules.items():
        if is_experts_module(module):
            parent = fqn.rpartition(".")[0]
            found.update(r for r in (f"{parent}.{n}" if parent else n for n in ROUTER_NAMES)
                         if r in modules and r not in exact)
    return found


def calibrate_experts(block: nn.Module, targets: dict[str, tuple[ExpertParameter, object]], inputs, plan,
                      undo) -> None:
    """GPTQ the expert Parameters ``targets`` of one block on its captured inputs; see Note [Expert calibration].
    Results go into ``plan`` (stack or UnsupportedWeight, and a note) and are installed through ``undo``."""
    for attr in _ORDER:
        stage = {fqn: t for fqn, t in targets.items() if t[0].attr == attr}
        stats = {}
        for fqn, (p, _) in stage.items():
            problem = structure_problem(p)
            if problem is not None:
                plan.weights[fqn] = UnsupportedWeight(problem)
            else:
                stats[fqn] = _ExpertInputs(p)
        if not stats:
            continue
        handles = [s.p.module.register_forward_pre_hook(s.hook, with_kwargs=True) for s in stats.values()]
        try:
            run_block(block, inputs)
        finally:
            for h in handles:
                h.remove()
        for fqn, s in stats.items():
            config = stage[fqn][1]
            try:
                stack, note = _gptq_stack(s, config)
            except UnsupportedWeight as e:
                plan.weights[fqn] = e
                continue
            plan.weights[fqn], plan.notes[fqn] = stack, note
            undo.set(s.p.module, s.p.attr, stack)
        stats.clear()  # free this Parameter's Hessians before the next stage


def structure_problem(p: ExpertParameter, method: str = "GPTQ") -> str | None:
    """Why ``method`` can't calibrate expert Parameter ``p`` (its module's structure), or None."""
    m = p.module
    if p.attr not in _ORDER:
        return f"{method} calibrates an experts module's gate_up_proj and down_proj, not {p.attr}"
    if (getattr(m, "is_transposed", False) or not isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
            or not callable(getattr(m, "act_fn", None))
            or any(n.endswith("_bias") and t is not None for n, t in m._parameters.items())):
        return (f"{method} of expert Parameters knows experts computing down_proj(act_fn(gate) * up) with untransposed "
                f"gate_up_proj / down_proj and no biases (Qwen3-MoE, Mixtral, OLMoE); {type(m).__name__} is "
                f"another structure: give {p.fqn} a weight-only config (ModuleConfigs)")
    return None


def routing(args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states, top_k_index) of a call of an experts module."""
    names = ("hidden_states", "top_k_index")
    values = list(args[:2]) + [kwargs[n] for n in names[len(args[:2]):] if n in kwargs]
    if len(values) < 2:
        raise ValueError("calibrating expert Parameters: the experts module was called without (hidden_states, "
                         "top_k_index); only transformers' experts call convention is known")
    return values[0], values[1]


class _ExpertInputs:
    """Per-expert Hessians of one expert Parameter's inputs, filled by a forward pre-hook on its module."""

    def __init__(self, p: ExpertParameter):
        self.p = p
        self.count = getattr(p.module, p.attr).shape[0]
        self.hessians: dict[int, HessianAccumulator] = {}  # allocated for experts that get tokens only

    def hook(self, module, args, kwargs):
        hidden, index = routing(args, kwargs)
        x = hidden.detach().reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            for e, rows in routed_rows(x, index, self.count):
                if self.p.attr == "down_proj":
                    rows = expert_intermediate(module, e, rows)
                h = self.hessians.get(e)
                if h is None:
                    h = self.hessians[e] = HessianAccumulator(rows.shape[-1], device=rows.device)
                h.add(rows)



def routed_rows(x: torch.Tensor, index: torch.Tensor, count: int):
    """(e, the rows of x routed to expert e) for every expert the routing `index` (one row of top-k expert ids per
    row of x) sends rows to."""
    index = index.reshape(x.shape[0], -1)
    for e in torch.unique(index).tolist():
        if 0 <= e < count:  # some implementations pad with index E: no expert
            yield e, x[(index == e).any(dim=-1)]


def expert_intermediate(module, e: int, x: torch.Tensor) -> torch.Tensor:
    """down_proj[e]'s input for rows x routed to expert e: act_fn(gate) * up from the module's gate_up_proj[e]."""
    w = module.gate_up_proj[e]
    if isinstance(w, AffineQuantizedTensor):
        w = w.dequantize(torch.float32)
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _gptq_stack(s: _ExpertInputs, config: GPTQConfig):
    """(stack, report note): each expert by GPTQ on its Hessian, or round-to-nearest when it got no tokens."""
    weight = getattr(s.p.module, s.p.attr).detach()
    experts, missing = [], []
    for e in range(s.count):
        name = f"{s.p.fqn}[{e}]"
        grid = ConfigGrid(config.base, weight[e], name)  # raises UnsupportedWeight naming the expert
        h = s.hessians.get(e)
        if h is None:
            missing.append(e)
            experts.append(grid.probe)  # the config's own round-to-nearest tensor
            continue
        codes, scale, zero = gptq_codes(weight[e], h.h, grid, damp=config.damp, block=config.block,
                                        act_order=config.act_order, static_groups=config.static_groups, name=name)
        experts.append(grid.pack(codes, scale, zero))
    rows = [s.hessians[e].rows for e in sorted(s.hessians)]
    return stack_experts(experts, s.p.fqn), expert_calibration_note("gptq", rows, missing, s.count, s.p.fqn)


def expert_calibration_note(method: str, rows: list[int], missing: list[int], count: int, fqn: str,
                            without_tokens: str = "round-to-nearest") -> str:
    """The report's note on a calibrated expert stack: the routed rows per expert and the experts that got none
    (``without_tokens``: what became of them; GPTQ and AWQ round them to nearest)."""
    note = (f"{method} per expert on its routed tokens ({min(rows)} to {max(rows)} rows)" if rows
            else f"{method}: no expert got calibration tokens")
    if missing:
        which = ", ".join(map(str, missing))
        note += (f"; expert{'s' if len(missing) > 1 else ''} {which} of {count} of {fqn} got no calibration tokens: "
                 f"{without_tokens}")
    return note
