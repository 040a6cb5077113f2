"""Calibrated quantization inside quantize_: GPTQ, AWQ, SmoothQuant and static activation scales, block by block.

See Note [Block-by-block calibration] (algorithms/blockwise.py) for the memory plan. For each decoder block:
1. one pass of the first batch finds which Linears share an input (q/k/v, gate/up) and which op of the block
   produced it (a norm whose output is that input, or the MLP's up_proj for down_proj): the fold targets;
2. a pass over every batch collects each shared input's statistics (InputStats);
3. AWQ / SmoothQuant scales are chosen and folded (x / s into the fold target, W s into the Linears); where
   there is no fold target, or folding would change the model (a post-norm block), 1 / s stays on each Linear's
   quantized weight as its ``input_scale`` (see Note [Input scale], tensor/affine_quantized_tensor.py);
4. every selected Linear of the block is quantized (GPTQ codes, AWQ-clipped weights, static scales, or the
   plain config) and installed, and the block runs again to give the next block its (quantized) inputs.
Linears outside the blocks (a pooler, an lm_head the user quantizes) are calibrated last, the same way, on one
more pass of the whole model (its blocks already quantized) with the model as their "block".
Every change is undone at the end (or on any error): quantize_ then swaps the planned weights in as usual,
so a failure anywhere leaves the model as it was.
"""
from __future__ import annotations

import warnings

import dataclasses
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..algorithms.awq import CLIP_ROWS, awq_clip, awq_scales
from ..progress import ProgressLine, progress_enabled
from ..algorithms.blockwise import (capture_block_inputs, check_finite_activation, find_blocks,
                                    run_block)
from ..algorithms.gptq import gptq_codes
from ..algorithms.observers import InputStats, static_activation_scale
from ..algorithms.smoothquant import smoothing_scales
from ..algorithms.rotation import online_rotation_of
from ..tensor.affine_quantized_tensor import INPUT_SCALE, AffineQuantizedTensor
from .block_edits import Undo as _Undo, block_output as _block_output, fold_scales as _fold, is_norm as _is_norm
from .block_edits import same_function as _same_function
from .awq_experts import awq_experts
from .smoothquant_experts import smooth_experts
from .calibrate_experts import calibrate_experts, expert_targets, router_fqns, takes_static_or_smoothing
from .calibration_grid import ConfigGrid
from .configs.base import handler_for
from .configs.calibrated import AWQConfig, GPTQConfig, SmoothQuantConfig
from .configs.sparsity import SparsityConfig
from .module_configs import ModuleConfigs
from .quantize_weight import UnsupportedWeight
from .sparsify import calibrated_sparse_weight

__all__ = ["CalibrationData", "CalibrationPlan", "calibrate_model"]

# AWQ's clipping search skips attention query / key projections: their errors pass through softmax, which
# the output-error objective of one Linear doesn't see (AutoAWQ skips them too).
_NO_CLIP = ("q_proj", "k_proj", "query", "key")


@dataclass
class CalibrationData:
    """Calibration batches for ``quantize_``, plus how to run them.

    Pass it as ``quantize_(..., calibration_data=...)`` instead of a plain iterable of batches when the defaults
    need changing: the decoder-block list to calibrate block by block, the progress line, or how many token rows
    are sampled per Linear input.

    Args:
        batches (Iterable): model inputs, each a tensor, a tuple of positional arguments, or a dict of keyword
            arguments. Read twice when Linears outside the blocks need calibration too.
        blocks (str | None): the fqn of the model's decoder-layer list (an ``nn.ModuleList`` or ``nn.Sequential``,
            e.g. ``"model.layers"``); None (default): found (the longest ModuleList of at least two modules of one
            class, else the whole model).
        progress (bool | None): a progress line on stderr, one step per decoder block; default None: shown when
            stderr is a terminal.
        max_rows (int): token rows sampled per Linear input for AWQ's searches and the percentile observers;
            default 1024.

    Example:
        ```python
        import torchqkit as qk
        batches = [tokenizer(text, return_tensors="pt").input_ids for text in texts]
        data = qk.CalibrationData(batches, blocks="model.layers", progress=False)
        qk.quantize_(model, qk.GPTQConfig(qk.Int4WeightOnlyConfig(group_size=128)), calibration_data=data)
        ```
    """
    batches: Iterable
    blocks: str | None = None
    progress: bool | None = None
    max_rows: int = 1024


@dataclass
class CalibrationPlan:
    weights: dict[str, AffineQuantizedTensor | UnsupportedWeight] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    float_updates: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list)

    def apply_float_updates(self) -> None:
        for module, attr, param in self.float_updates:
            setattr(module, attr, param)


def calibrate_model(model: nn.Module, modules: dict[str, nn.Module], configs: ModuleConfigs, selected,
                    calibration_data, expert_filter=None) -> CalibrationPlan:
    """The quantized weights (and folded float parameters) of every selected Linear inside the model's decoder
    blocks, and of expert Parameters with a GPTQ, AWQ, SmoothQuant or static-activation config (Note [Expert
    calibration], calibrate_experts.py; Note [AWQ of expert Parameters], awq_experts.py; Note [SmoothQuant and static
    activation scales of expert Parameters], smoothquant_experts.py; selected
    by ``expert_filter`` when given), when some config needs calibration data; an empty plan otherwise (data, if
    any, is ignored)."""
    exact = set(configs.exact_keys())
    routers = router_fqns(modules, exact)  # they stay float (expert_weights.py), during calibration too
    chosen = {fqn: configs.lookup(fqn)[1] for fqn, m in modules.items()
              if isinstance(m, nn.Linear) and (fqn in exact or selected(m, fqn)) and fqn not in routers}
    experts = expert_targets(modules, configs, expert_filter)
    needing = sorted({type(c).__name__ for c in [*chosen.values(), *(c for _, c in experts.values())]
                      if c is not None and c.needs_calibration_data()})
    if not needing:
        return CalibrationPlan()
    if calibration_data is None:
        fqns = [fqn for fqn, c in [*chosen.items(), *((f, c) for f, (_, c) in experts.items())]
                if c is not None and c.needs_calibration_data()]
        more = f" and {len(fqns) - 3} more" if len(fqns) > 3 else ""
        raise ValueError(f"{', '.join(needing)} need(s) calibration data (for {', '.join(fqns[:3])}{more}): pass "
                         f"calibration_data=<iterable of model inputs> to quantize_ (e.g. a few tokenized text "
                         f"batches); the model was not changed")
    data = calibration_data if isinstance(calibration_data, CalibrationData) else CalibrationData(calibration_data)
    list_fqn, blocks = find_blocks(model, data.blocks)
    block_names = [_name_of(modules, b) for b in blocks]
    undo, plan = _Undo(), CalibrationPlan()
    batches = list(data.batches)  # read twice when Linears outside the blocks need calibration too
    shared = _shared_weights(model)
    try:
        inputs = capture_block_inputs(model, blocks[0], batches)
        show = progress_enabled(data.progress)
        progress = ProgressLine(f"calibrate {', '.join(needing)} over {list_fqn or 'the model'}", len(blocks),
                                "blocks", enabled=show, min_interval=0.0)
        for i, (prefix, block) in enumerate(zip(block_names, blocks)):
            linears = {fqn: (modules[fqn], chosen[fqn]) for fqn in chosen
                       if _inside(fqn, prefix) and chosen[fqn] is not None}
            if linears:
                _calibrate_block(block, prefix, linears, inputs, data, plan, undo, shared)
            stacks = {fqn: t for fqn, t in experts.items() if _inside(fqn, prefix)}
            awq = {fqn: t for fqn, t in stacks.items() if isinstance(t[1], AWQConfig)}
            smooth = {fqn: t for fqn, t in stacks.items() if takes_static_or_smoothing(t[1])}
            gptq = {fqn: t for fqn, t in stacks.items() if fqn not in awq and fqn not in smooth}
            rows = sum(_rows(inp) for inp in inputs)
            if awq:  # after the block's Linears: the experts see the quantized attention's outputs
                awq_experts(block, prefix, awq, inputs, plan, undo, rows, data.max_rows)
            if smooth:
                smooth_experts(block, prefix, smooth, inputs, plan, undo, rows, data.max_rows)
            if gptq:
                calibrate_experts(block, gptq, inputs, plan, undo)
            inputs = run_block(block, inputs) if i + 1 < len(blocks) else []
            progress.update(i + 1, f"({len(linears)} Linears, {len(stacks)} expert Parameters)")
        progress.close()
        outside = {fqn: (modules[fqn], c) for fqn, c in chosen.items()
                   if c is not None and blocks[0] is not model and not any(_inside(fqn, p) for p in block_names)}
        if any(c.needs_calibration_data() for _, c in outside.values()):
            _calibrate_block(model, "", outside, capture_block_inputs(model, model, batches), data, plan, undo, shared)
            if show:
                print(f"calibrate: outside the blocks: {', '.join(outside)}", file=sys.stderr, flush=True)
    finally:
        changed = undo.restore()
    quantized = {id(modules[fqn]) for fqn, w in plan.weights.items()
                 if isinstance(w, AffineQuantizedTensor) and fqn in modules}  # not expert Parameters' names
    plan.float_updates = [(m, a, p) for m, a, p in changed
                          if not (a == "weight" and id(m) in quantized) and not isinstance(p, AffineQuantizedTensor)]
    return plan


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (a tied lm_head / embedding): their columns can't be scaled,
    the other holder (an embedding lookup) would read the scaled weight."""
    seen: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def _name_of(modules: dict[str, nn.Module], block: nn.Module) -> str:
    return next(fqn for fqn, m in modules.items() if m is block)


def _inside(fqn: str, prefix: str) -> bool:
    return prefix == "" or fqn.startswith(prefix + ".")


# ------------------------------------------------------------------------------------------------ one block

@dataclass
class _Group:
    """Linears of one block that read the same input tensor, and the op that produced it (or None)."""
    members: list[str]
    fold: tuple[str, nn.Module] | None = None
    stats: InputStats | None = None
    smooth: torch.Tensor | None = None
    on_layer: bool = False  # smooth kept as the members' input_scale (W s quantized, x / s in their linear)
    note: str = ""


def _calibrate_block(block, prefix, linears, inputs, data, plan, undo, shared: set[int]) -> None:
    """Calibrate and quantize the Linears of one block. With a true-sequential GPTQ config among them, one group of
    Linears (one shared input) at a time, in the block's order: each group's statistics then come from a pass with
    the groups before it already quantized (o_proj sees quantized q/k/v's outputs), one block pass per group."""
    groups = _find_groups(block, prefix, linears, inputs[0])
    total_rows = sum(_rows(inp) for inp in inputs)
    sequential = any(getattr(config, "true_sequential", False) for _, config in linears.values())
    for stage in ([g] for g in groups) if sequential else [groups]:
        _calibrate_groups(block, stage, linears, inputs, data, plan, undo, shared, total_rows)


def _calibrate_groups(block, groups, linears, inputs, data, plan, undo, shared, total_rows) -> None:
    for g in groups:  # statistics only for inputs some config needs them for
        if any(linears[f][1].needs_calibration_data() for f in g.members):
            k = linears[g.members[0]][0].in_features
            hessian = any(_needs_hessian(linears[f][1]) for f in g.members)
            g.stats = InputStats(k, total_rows, hessian=hessian, max_rows=data.max_rows)
    if any(g.stats is not None for g in groups):
        _collect(block, linears, groups, inputs)
    if any(_scaler(g, linears)[0] is not None for g in groups):
        reference = _block_output(block, inputs[0])
        for g in groups:
            _scale_group(g, linears, undo, lambda: _same_function(_block_output(block, inputs[0]), reference),
                         shared)
    for g in groups:
        for fqn in g.members:
            module, config = linears[fqn]
            try:
                qweight = _quantize_member(fqn, module, config, g)
            except UnsupportedWeight as e:
                plan.weights[fqn] = e
                continue
            plan.weights[fqn] = qweight
            if g.note:
                plan.notes[fqn] = g.note
            undo.set(module, "weight", qweight)
        g.stats = None  # free this block's statistics before the next block


def _needs_hessian(config) -> bool:
    """GPTQ and SparseGPT read the Hessian of a Linear's inputs (K x K); the other algorithms per-channel statistics."""
    return isinstance(config, GPTQConfig) or (isinstance(config, SparsityConfig) and config.needs_hessian())


def _rows(inp) -> int:
    """Token rows of one batch: hidden states (..., K) inside a block; token ids (or a dict of them) for a model."""
    x = inp.args[0] if inp.args else next(iter(inp.kwargs.values()))
    if isinstance(x, dict):
        x = next(v for v in x.values() if isinstance(v, torch.Tensor))
    return x.numel() // x.shape[-1] if x.is_floating_point() else x.numel()


def _find_groups(block, prefix, linears, first) -> list[_Group]:
    """Group the Linears by identical input on one batch, and find each group's fold target."""
    seen_inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    handles = [linears[f][0].register_forward_pre_hook(_recorder(seen_inputs, f)) for f in linears]
    norms = {f"{prefix}.{n}" if prefix else n: m for n, m in block.named_modules() if _is_norm(m)}
    handles += [m.register_forward_hook(_output_recorder(outputs, f)) for f, m in norms.items()]
    try:
        run_block(block, [first])
    finally:
        for h in handles:
            h.remove()
    groups: list[_Group] = []
    for fqn in linears:
        x = seen_inputs.get(fqn)
        same = next((g for g in groups if seen_inputs.get(g.members[0]) is x and x is not None), None)
        if same is not None:
            same.members.append(fqn)
            continue
        g = _Group([fqn])
        norm = next((f for f, y in outputs.items() if x is not None and y.shape == x.shape and torch.equal(y, x)), None)
        if norm is not None:
            g.fold = (norm, norms[norm])
        else:
            g.fold = _mlp_up_proj(fqn, linears, block, prefix)
        groups.append(g)
    return groups


def _recorder(store, fqn):
    def hook(module, args):
        store.setdefault(fqn, args[0])
    return hook


def _output_recorder(store, fqn):
    def hook(module, args, out):
        if isinstance(out, torch.Tensor):
            store.setdefault(fqn, out)
    return hook


def _mlp_up_proj(fqn, linears, block, prefix):
    """A gated MLP's down_proj reads act(gate_proj(x)) * up_proj(x): its input scales fold into up_proj's rows,
    unless rotate_ rotates down_proj's input on every call (a channel of up_proj is no channel of down_proj then)."""
    if not fqn.endswith(".down_proj") or online_rotation_of(linears[fqn][0]) is not None:
        return None
    up = fqn[: -len("down_proj")] + "up_proj"
    mods = dict(block.named_modules())
    local = up[len(prefix) + 1:] if prefix else up
    m = mods.get(local)
    return (up, m) if isinstance(m, nn.Linear) else None


# Note [GPTQ Hessians under dynamic activations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A GPTQConfig base may quantize activations at run time (int8 x int8, int8 x intx (W4A8), int4 x int4, float8 x
# int4): the installed layer computes Q(x) Wq^T, Q the base's per-token (or per-group) rounding. GPTQ chooses only
# Wq's codes, on the base's own weight grid (ConfigGrid: its bits, group size, mapping); the activation spec, layout
# and kernel preference are the base's, so the layer takes the same kernel route round-to-nearest would give it.
#
# The Hessian H = 2/n sum x x^T is taken from each Linear's input as it enters the layer (the pre-hook in _collect),
# before the layer rounds it: the activations are not fake-quantized for it. That input already carries the rounding
# upstream: the blocks before this one run with their quantized weights installed (their real linears, activation
# rounding included), and with true_sequential so do the Linears before o_proj / down_proj. Why x and not Q(x):
# - the layer's error is x (Wq - W)^T + (Q(x) - x) Wq^T; GPTQ minimises the first term, whose mean square is
#   tr((Wq - W) H (Wq - W)^T) with H from x exactly. The second term is the activation rounding, which the codes
#   barely change;
# - for int8, Q(x)'s Hessian differs from x's by at most (max|x| / 127)^2 / 12 per diagonal entry (uniform rounding
#   noise), under GPTQ's damping (1% of the mean diagonal) unless a token's largest entry is ~40x its RMS. On the
#   tiny test LLaMA (3 seeds, W4A8 g16) GPTQ's logits error over round-to-nearest's was 0.74 / 0.88 / 0.82 from x and
#   0.77 / 0.90 / 0.78 from Q(x): no consistent difference.
# 4-bit activations round 16x more coarsely, and there Q(x) measured slightly better on the same model (0.95 / 0.92
# / 1.09 from x, 0.89 / 0.89 / 1.02 from Q(x)); a model of 14 tiny Linears doesn't settle it, so every base gets x.
def _collect(block, linears, groups, inputs) -> None:
    def hook_for(g: _Group, fqn: str):
        def hook(module, args):
            check_finite_activation(args[0], fqn)
            if args[0].shape[:-1].numel() == 0:
                warnings.warn(f"calibration: a batch reached {fqn} with 0 tokens (input shape {tuple(args[0].shape)}); "
                              f"it adds no statistics and is skipped", stacklevel=2)
                return
            g.stats.add(args[0])
        return hook

    handles = [linears[g.members[0]][0].register_forward_pre_hook(hook_for(g, g.members[0]))
               for g in groups if g.stats is not None]
    try:
        run_block(block, inputs)
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------------ scaling

def _scaler(g: _Group, linears):
    """(AWQConfig, SmoothQuantConfig or None: how this input is scaled; whether every member agrees)."""
    kinds = {_scaling_kind(linears[f][1]) for f in g.members}
    for kind in (AWQConfig, SmoothQuantConfig):
        if kind in kinds:
            members = {linears[f][1] for f in g.members}
            return kind, kinds == {kind} and len({_alpha(c) for c in members}) == 1
    return None, True


def _scaling_kind(config):
    """A static-activation config that calibrates with ``smoothing`` scales its input as SmoothQuant does."""
    if isinstance(config, (AWQConfig, SmoothQuantConfig)):
        return type(config)
    return SmoothQuantConfig if getattr(config, "smoothing", None) is not None and config.act_scale is None else None


def _alpha(config) -> float | None:
    if isinstance(config, SmoothQuantConfig):
        return config.alpha  # the wrapper's strength replaces its base's own smoothing
    return getattr(config, "smoothing", None)


def _scale_group(g: _Group, linears, undo: _Undo, unchanged, shared: set[int]) -> None:
    kind, alone = _scaler(g, linears)
    if kind is None:
        return
    name = "awq" if kind is AWQConfig else "smoothquant"
    if not alone:
        g.note = f"{name}: not scaled, the Linears sharing this input ({', '.join(g.members)}) have other configs"
        return
    tied = [f for f in g.members if id(linears[f][0].weight) in shared]
    if tied:
        g.note = (f"{name}: not scaled, the weight of {', '.join(tied)} is shared with another module (tied): it "
                  f"would read the scaled columns")
        return
    weights = [linears[f][0].weight.detach() for f in g.members]
    if kind is AWQConfig:
        config = linears[g.members[0]][1]
        grids = [ConfigGrid(linears[f][1].base, w, f"{f}.weight") for f, w in zip(g.members, weights)]
        s, ratio = awq_scales(g.stats.sample(), g.stats.mean_abs, weights, [gr.fake_quantize for gr in grids],
                              config.n_grid)
        what = f"awq: scales mean|x|^{ratio:.2f}"
    else:
        alpha = _alpha(linears[g.members[0]][1])
        s = smoothing_scales(g.stats.absmax, weights, alpha)
        what = f"smoothquant alpha {alpha:g}: scales"
    g.smooth = s
    if g.fold is None:
        g.on_layer = True
        g.note = f"{what} kept on the layer as its input_scale (no norm / Linear before this input to fold 1/s into)"
        return
    g.note = f"{what} folded into {g.fold[0]}"
    mine = _Undo()
    _fold(g.fold[1], s, mine)
    for f, w in zip(g.members, weights):
        mine.set(linears[f][0], "weight", (w.float() * s).to(w.dtype))
    if not unchanged():  # e.g. a post-norm block: the norm's output is also the residual, so 1/s can't go there
        mine.restore()
        g.on_layer = True
        g.note = (f"{what} kept on the layer as its input_scale (folding 1/s into {g.fold[0]} would change the "
                  f"model: its output feeds more than these Linears)")
        return
    undo.adopt(mine)


# ------------------------------------------------------------------------------------------------ quantize

def _quantize_member(fqn: str, module: nn.Linear, config, g: _Group) -> AffineQuantizedTensor:
    """The member's quantized weight; with the group's scales kept on the layer (``g.on_layer``), W s quantized and
    1 / s stored as its input_scale."""
    weight = module.weight.detach()
    if not g.on_layer:
        return _quantize_weight(fqn, weight, config, g)
    scaled = (weight.float() * g.smooth).to(weight.dtype)
    return _quantize_weight(fqn, scaled, config, g).with_changes({INPUT_SCALE: (1.0 / g.smooth).float()})


def _quantize_weight(fqn: str, weight: torch.Tensor, config, g: _Group) -> AffineQuantizedTensor:
    name = f"{fqn}.weight"
    if isinstance(config, SparsityConfig) and config.needs_calibration_data():
        return calibrated_sparse_weight(config, weight, g.stats, name)
    if isinstance(config, GPTQConfig):
        grid = ConfigGrid(config.base, weight, name)
        codes, scale, zero = gptq_codes(weight, g.stats.hessian.h, grid, damp=config.damp, block=config.block,
                                        act_order=config.act_order, static_groups=config.static_groups, name=name)
        return grid.pack(codes, scale, zero)
    if isinstance(config, AWQConfig):
        if config.clip and not fqn.rsplit(".", 1)[-1] in _NO_CLIP:
            grid = ConfigGrid(config.base, weight, name)
            x = g.stats.sample()[:CLIP_ROWS] / (g.smooth if g.smooth is not None else 1.0)
            weight = awq_clip(x, weight, grid.fake_quantize, grid.group_size, config.n_grid).to(weight.dtype)
        config = config.base
    elif isinstance(config, SmoothQuantConfig):
        config = config.base
    if config.needs_calibration_data():  # static activation scale, after any smoothing
        config = dataclasses.replace(config, act_scale=static_activation_scale(config, g.stats, g.smooth, weight)[1])
    return handler_for(config)(config, weight, name)
