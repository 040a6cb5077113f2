"""quantize_: swap nn.Linear weights for AffineQuantizedTensors in place.

Two phases, so a failure leaves the model as it was: (1) plan and quantize every selected weight
without touching the model; (2) swap the parameters and patch ``extra_repr``. Shared steps live here
once; a config's handler only turns one float weight into one quantized weight.

Note [Shared weights]
~~~~~~~~~~~~~~~~~~~~~
A Parameter held by several modules (lm_head tied to the input embedding, two Linears on one weight) is
one weight: found by identity over every module's own parameters, planned once by the first selected
Linear holding it (its "owner", in module order), and swapped as ONE new Parameter into every holder,
so it stays shared. Other holders report status "shared" with 0 -> 0 bytes (the owner counts the storage
once); a different config of theirs is not applied and the report says so. A weight that a non-Linear
module also holds (an nn.Embedding) stays in float unless the owner is named exactly in ModuleConfigs, as
transformers' quantizers leave lm_head alone; named, it is quantized and the embedding reads the quantized
Parameter (``aten.embedding`` gathers rows, see Note [Quantized embedding]). An embedding named exactly is
selected too (Note [Weight-bearing modules]); a tied one comes first in module order, so it then decides for
the Linear, which reports it.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..progress import ProgressLine, progress_enabled
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .calibrate import CalibrationPlan, calibrate_model
from .configs.base import QuantConfig, handler_for
from .module_configs import ModuleConfigs
from .quantize_weight import UnsupportedWeight
from .after_quantize import run_after_quantize
from .expert_weights import plan_experts
from .float_reads import float_read_notes
from .report import LayerReport, QuantizationReport
from .weight_modules import (is_gpt2_conv1d, is_linear_like, is_weight_module, module_problem, stored_weight,
                             weight_to_quantize, with_embeddings)

__all__ = ["quantize_", "plan_quantize", "as_module_configs", "quantize_layer", "complete_quantization_",
           "QuantizationError", "patch_extra_repr", "quantize_named_weight"]


# quantize_'s default shows its progress line (on a terminal) from this many layers: a small model is done at once.
PROGRESS_MIN_LAYERS = 50

class QuantizationError(ValueError):
    """Raised by ``quantize_(..., strict=True)`` when a selected layer can't be quantized.

    The message names every such layer and why; the model is left unchanged. Without ``strict`` the same layers
    stay in float, ``quantize_`` warns, and the returned report lists them as ``"skipped"``. A ``ValueError``.

    Example:
        ```python
        import torchqkit as qk
        try:
            qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128), strict=True)
        except qk.QuantizationError as e:
            print("model left unchanged:", e)
        ```
    """


class _Holder(NamedTuple):
    fqn: str             # module name
    module: nn.Module
    attr: str            # the module's name for the Parameter


class _Owned(NamedTuple):
    entry: LayerReport   # the owner's report entry
    config: object       # the config the owner was planned with (None when kept)
    weight: AffineQuantizedTensor | None


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) or is_gpt2_conv1d(module)  # Note [Weight-bearing modules]


def quantize_(model: nn.Module, config, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
              device=None, strict: bool = False, calibration_data=None,
              progress: bool | None = None, embeddings=None) -> QuantizationReport:
    """Quantize the weights of ``model``'s Linear layers in place and report what happened to each.

    Each selected Linear's weight is replaced by an ``AffineQuantizedTensor`` in the config's format; the modules
    stay ``nn.Linear`` and their ``extra_repr`` shows the config. Work happens in two phases (plan and quantize
    every weight, then swap them in), so an error leaves the model as it was. A layer the config can't take
    (shape, dtype, NaN weights, ...) stays in float and is reported as ``"skipped"`` with the reason, with a
    warning (or ``QuantizationError`` with ``strict=True``). A weight shared by several modules (a tied lm_head)
    is quantized once and stays shared; a weight an ``nn.Embedding`` also holds stays in float unless its Linear is
    named exactly in a ``ModuleConfigs`` (the ``"-out8"`` presets do). Besides ``nn.Linear``: transformers' GPT-2
    ``Conv1D`` (selected by default; its (in, out) weight is quantized along ``in``), 1x1 ``nn.Conv1d`` /
    ``nn.Conv2d`` (when ``filter_fn`` selects or ``ModuleConfigs`` names them; other kernels and grouped
    convolutions are reported as skipped), ``nn.Embedding`` (named, or with ``embeddings=``) and the 3-d expert
    Parameters of mixture-of-experts models (transformers' ``*Experts`` modules), each expert on its own, one
    entry per Parameter (``...mlp.experts.gate_up_proj``); their router stays float (docs/guides/moe.md).

    Args:
        model (torch.nn.Module): the model to quantize, changed in place.
        config (QuantConfig | ModuleConfigs): one config for every selected Linear, or a ``ModuleConfigs`` of
            per-module configs (mixed precision; None values keep modules in float).
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` says which modules to
            consider; None (default): every ``nn.Linear`` and GPT-2 ``Conv1D``. Keyword-only, as are the arguments
            below.
        device (torch.device | str | None): quantize (and leave) the selected layers on this device; None
            (default): where they are.
        strict (bool): raise ``QuantizationError`` (changing nothing) instead of reporting layers that can't be
            quantized; default False.
        calibration_data (Iterable | CalibrationData | None): model inputs (an iterable of tensors, tuples or
            keyword dicts, or a ``CalibrationData``) for configs that need them (``GPTQConfig``, ``AWQConfig``,
            ``SmoothQuantConfig``, static activation configs without ``act_scale``); ignored when no config needs
            it. Default None.
        progress (bool | None): a progress line on stderr while layers are quantized; None (default): when stderr
            is a terminal and the model has at least 50 layers to quantize.
        embeddings (QuantConfig | None): a config for every standalone ``nn.Embedding`` (its weight held by no
            other module) that ``config`` does not name exactly; lookups then dequantize only the rows they read.
            None (default): embeddings stay float unless a ``ModuleConfigs`` names them. A tied embedding follows
            its output Linear.

    Returns:
        QuantizationReport: one entry per reported layer (``"quantized"``, ``"shared"``, ``"skipped"`` or
            ``"kept"``), with byte counts before and after; ``print(report)`` shows a table, and ``notes`` a
            float weight left that reads more bytes per token than the quantized Linears.

    Raises:
        QuantizationError: with ``strict=True``, when a selected layer can't be quantized.
        TypeError: ``config`` is not a registered config or a ``ModuleConfigs``, or ``embeddings`` is not a config.
        ValueError: a config needs calibration data and none was given.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128))
        print(report)
        assert not report.skipped
        qk.quantize_(other, qk.presets.get("int4-wo-g32-out8"), embeddings=qk.Int8WeightOnlyConfig())
        ```
    """
    report = _quantize_model(model, config, filter_fn, device, strict, {}, calibration_data, progress, embeddings)
    run_after_quantize(model, config)  # e.g. transformers learns the model's new quantizer (after_quantize.py)
    return report


def complete_quantization_(model: nn.Module, config, quantized: dict[str, LayerReport], *,
                           strict: bool = False) -> QuantizationReport:
    """Finish what a loader began: ``quantized`` maps module names to the entries of layers it already planned
    with ``quantize_layer`` (their new weights swapped in). Every other layer is planned and swapped as quantize_
    would, and the report is the one quantize_ gives for the float model. Shared weights (a tied lm_head) are
    decided here, once every holder is loaded."""
    return _quantize_model(model, config, None, None, strict, quantized)


def _quantize_model(model, config, filter_fn, device, strict, done, calibration_data=None,
                    progress=False, embeddings=None) -> QuantizationReport:
    report, swaps, calibrated = _plan(model, config, filter_fn, device, done, calibration_data, progress, embeddings)
    problems = report.skipped
    if problems and strict:
        raise QuantizationError("quantize_(strict=True): the model was left unchanged because "
                                + "; ".join(f"{e.fqn}: {e.reason}" for e in problems))
    for swap in swaps:
        _swap_weight(swap.holders, swap.weight, device)
    calibrated.apply_float_updates()  # scales folded into norms (AWQ, SmoothQuant)
    if problems:
        warnings.warn(f"torchqkit.quantize_: {len(problems)} selected layer(s) left unquantized: "
                      + "; ".join(f"{e.fqn} ({e.reason})" for e in problems[:5])
                      + (" ..." if len(problems) > 5 else "") + ". See the returned report; strict=True raises.",
                      stacklevel=3)
    return report


class Swap(NamedTuple):
    holders: list[_Holder]           # every (module, attribute) that holds the weight
    weight: AffineQuantizedTensor    # what they will hold


def plan_quantize(model: nn.Module, config, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
                  device=None) -> tuple[QuantizationReport, list[Swap]]:
    """Phase 1 of ``quantize_`` on its own: the report ``quantize_`` would return and the weights it would swap
    in, without touching ``model``. Training (``prepare_qat_``) uses it to fake-quantize exactly the layers a
    later conversion quantizes."""
    report, swaps, _ = _plan(model, config, filter_fn, device, {})
    return report, swaps


def _plan(model, config, filter_fn, device, done, calibration_data=None, progress=False, embeddings=None):
    modules = dict(model.named_modules())
    holders = _shared_parameters(modules)
    configs = with_embeddings(as_module_configs(config), embeddings, modules, holders)
    for c in configs.configs.values():
        if c is not None:
            handler_for(c)  # unknown config types fail before anything happens
    configs.check_patterns(modules)  # a pattern too slow for a name fails now, not after calibration
    selected = filter_fn or _default_filter
    expert_filter = None if selected is _default_filter else selected
    calibrated = calibrate_model(model, modules, configs, selected, calibration_data, expert_filter)  # changes nothing
    report, swaps = _plan_model(modules, holders, configs, selected, device, done, calibrated, progress)
    report.notes = float_read_notes(report, modules, holders, configs)
    return report, swaps, calibrated


def _plan_model(modules: dict[str, nn.Module], holders: dict[int, list[_Holder]], configs: ModuleConfigs,
                selected: Callable, device, done: dict[str, LayerReport], calibrated: CalibrationPlan,
                progress: bool | None = False):
    """Phase 1: the report, and (holders, quantized weight) pairs to swap. Touches nothing. ``done``: entries of
    layers a loader already quantized (complete_quantization_); they are reported as planned then."""
    exact = set(configs.exact_keys())
    entries: dict[str, LayerReport] = {}
    owned: dict[int, _Owned] = {}  # id(Parameter) -> its owner's plan, see Note [Shared weights]
    # 3-d expert Parameters and their routers: Note [Expert Parameters in quantize_] (expert_weights.py)
    experts = plan_experts(modules, configs, None if selected is _default_filter else selected, device, calibrated)
    chosen = [fqn for fqn, module in modules.items()
              if (fqn in exact or selected(module, fqn)) and fqn not in experts.routers]
    bar = ProgressLine("quantize_", len(chosen), "layers",
                       enabled=progress_enabled(progress) and (progress or len(chosen) >= PROGRESS_MIN_LAYERS))
    for i, fqn in enumerate(chosen):
        module = modules[fqn]
        bar.update(i, fqn)
        weight = getattr(module, "weight", None)
        if fqn in done:
            entries[fqn] = done[fqn]
            if isinstance(module, nn.Linear):
                owned[id(weight)] = _Owned(done[fqn], configs.lookup(fqn)[1], None)  # already swapped
            continue
        if id(weight) in owned:
            entries[fqn] = _shared_entry(fqn, owned[id(weight)], configs.lookup(fqn)[1])
            continue
        entries[fqn], qweight = _plan_weight(fqn, module, holders.get(id(weight), []), configs, device,
                                             calibrated.weights.get(fqn), calibrated.notes.get(fqn, ""))
        if is_linear_like(module) or (is_weight_module(module) and qweight is not None):
            # an embedding decides a shared weight only when quantized: kept, its Linear decides
            owned[id(weight)] = _Owned(entries[fqn], configs.lookup(fqn)[1], qweight)
    bar.update(len(chosen))
    bar.close()
    swaps = []
    for pid, plan in owned.items():
        if plan.weight is None:
            continue
        targets = holders.get(pid) or [_Holder(plan.entry.fqn, modules[plan.entry.fqn], "weight")]
        swaps.append(Swap(targets, plan.weight))
        for h in targets:  # holders nobody selected (or a tied embedding kept for its Linear) read it too: say so
            if h.fqn not in entries or entries[h.fqn].status == "kept":
                entries[h.fqn] = _shared_entry(h.fqn, plan, plan.config)
    swaps += [Swap([_Holder(fqn, module, attr)], stack) for fqn, module, attr, stack in experts.swaps]
    order = {fqn: (i, 0) for i, fqn in enumerate(modules)}
    order.update({fqn: (order[anchor][0], 1) for fqn, anchor in experts.anchor.items() if fqn not in order})
    report = sorted([*entries.values(), *experts.entries], key=lambda e: order[e.fqn])
    report += [LayerReport(key, "skipped", "-", "ModuleConfigs names a module the model does not have", 0, 0)
               for key in sorted(exact - modules.keys() - set(experts.names))]
    report += [LayerReport(key, "skipped", "-", "ModuleConfigs pattern selects no module (it matches none, or only "
                           "modules an exact name or an earlier pattern takes)", 0, 0)
               for key in configs.unmatched([*modules, *experts.names])]
    return QuantizationReport(report), swaps


def as_module_configs(config) -> ModuleConfigs:
    """A QuantConfig as ModuleConfigs({"_default": config}); a ModuleConfigs as it is; anything else a TypeError."""
    if isinstance(config, ModuleConfigs):
        return config
    if isinstance(config, QuantConfig):
        return ModuleConfigs({"_default": config})
    handler_for(config)  # raises a TypeError listing the known configs
    raise AssertionError("unreachable")


def _shared_parameters(modules: dict[str, nn.Module]) -> dict[int, list[_Holder]]:
    """id(Parameter) -> every (module, attribute) holding it, in module order; only Parameters held twice or
    more. A module reachable under two names is one holder (named_modules yields it once)."""
    seen: dict[int, list[_Holder]] = {}
    for fqn, module in modules.items():
        for attr, p in module._parameters.items():
            if p is not None:
                seen.setdefault(id(p), []).append(_Holder(fqn, module, attr))
    return {pid: hs for pid, hs in seen.items() if len(hs) > 1}


def _plan_weight(fqn: str, module: nn.Module, group: list[_Holder], configs: ModuleConfigs, device,
                 calibrated=None, note: str = ""):
    """Plan one module's weight; ``group``: every holder when the Parameter is shared (Note [Shared weights])."""
    others = [h for h in group if not is_linear_like(h.module)]
    key, config = configs.lookup(fqn)
    weight = getattr(module, "weight", None)
    if group and isinstance(module, nn.Embedding) and config is not None and key != fqn:
        # An embedding tied to an output Linear follows the Linear unless named itself (Note [Shared weights])
        tied = ", ".join(h.fqn for h in group if h.module is not module)
        return LayerReport(fqn, "kept", config.describe(), f"tied to {tied}, kept in float; name {fqn!r} or "
                           f"{tied.split(', ')[0]!r} in ModuleConfigs to quantize both", _nbytes(weight),
                           _nbytes(weight)), None
    if (not others or config is None or not isinstance(module, nn.Linear) or weight.is_meta
            or isinstance(weight, AffineQuantizedTensor)):  # nothing to decide: the usual reasons apply
        return quantize_layer(fqn, module, configs, device, calibrated=calibrated, note=note)
    tied = ", ".join(f"{h.fqn}.{h.attr} ({type(h.module).__name__})" for h in others)
    nbytes = _nbytes(weight)
    if key != fqn:
        return LayerReport(fqn, "kept", config.describe(), f"tied to {tied}, kept in float; name {fqn!r} in "
                           f"ModuleConfigs to quantize both", nbytes, nbytes), None
    unable = [h for h in others if not _reads_quantized(h)]
    if unable:
        h = unable[0]
        return LayerReport(fqn, "skipped", config.describe(), f"weight tied to {h.fqn}.{h.attr}, a "
                           f"{type(h.module).__name__}, which can't read a quantized weight (torchqkit serves "
                           f"nn.Linear and nn.Embedding without max_norm); untie them first", nbytes, nbytes), None
    return quantize_layer(fqn, module, configs, device, calibrated=calibrated, note=note)


def _reads_quantized(h: _Holder) -> bool:
    return h.attr == "weight" and isinstance(h.module, nn.Embedding) and h.module.max_norm is None


def _shared_entry(fqn: str, owner: _Owned, mine) -> LayerReport:
    """The entry of a module holding ``owner``'s weight; ``mine``: the config it would have had."""
    reason = f"shares {owner.entry.fqn}.weight ({owner.entry.status} there, its bytes counted there)"
    if mine != owner.config:
        reason += (f"; its own config ({'None' if mine is None else mine.describe()}) was not applied: the first "
                   f"selected Linear holding the weight decides")
    return LayerReport(fqn, "shared", owner.entry.config, reason, 0, 0, shared_with=f"{owner.entry.fqn}.weight")


def _nbytes(weight) -> int:
    if isinstance(weight, AffineQuantizedTensor):
        return weight.packed_nbytes()
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0


def quantize_layer(fqn: str, module: nn.Module, configs: ModuleConfigs, device=None, weight=None, *,
                   calibrated=None, note: str = ""):
    """Plan one module: (its report entry, its quantized weight or None). Touches nothing. ``weight``: the float
    weight to use instead of ``module.weight`` (a loader's tensor while the module is still on the meta device).
    ``calibrated``: the weight calibration planned for it (api/calibrate.py), or why it could not; ``note``:
    what calibration did, for the report.
    Shared weights are not considered here: quantize_ decides them (Note [Shared weights])."""
    weight = getattr(module, "weight", None) if weight is None else weight
    problem = module_problem(module, weight)
    if problem is None:  # the (out, in) weight a config quantizes: Note [Weight-bearing modules]
        weight = weight_to_quantize(module, weight)
    return quantize_named_weight(fqn, weight, configs, device, calibrated=calibrated, note=note,
                                 problem=lambda: problem)


def quantize_named_weight(fqn: str, weight: torch.Tensor, configs: ModuleConfigs, device=None, *, calibrated=None,
                          note: str = "", problem=None):
    """Quantize one float weight as ``configs`` says for the layer ``fqn``: (its report entry, the quantized weight
    or None). Touches nothing. ``problem``: a callable giving why the layer can't be quantized (or None), asked
    once a config selects it. quantize_layer (modules) and quantize_checkpoint (tensors read from a file) both
    decide each weight here."""
    nbytes = _nbytes(weight)
    key, config = configs.lookup(fqn)
    if key is None:
        return LayerReport(fqn, "kept", "-", "no config matched (no exact name, pattern or _default)", nbytes, nbytes), None
    if config is None:
        return LayerReport(fqn, "kept", "-", f"ModuleConfigs[{key!r}] is None", nbytes, nbytes), None
    desc = config.describe()
    reason = None if problem is None else problem()
    if reason is not None:
        return LayerReport(fqn, "skipped", desc, reason, nbytes, nbytes), None
    w = weight.detach() if device is None else weight.detach().to(device)
    try:
        if isinstance(calibrated, UnsupportedWeight):
            raise calibrated
        qweight = handler_for(config)(config, w, f"{fqn}.weight") if calibrated is None else calibrated.to(w.device)
    except UnsupportedWeight as e:
        return LayerReport(fqn, "skipped", desc, str(e), nbytes, nbytes), None
    except ValueError as e:  # numerics refused the data, e.g. NaN/Inf in the weight
        return LayerReport(fqn, "skipped", desc, str(e), nbytes, nbytes), None
    return LayerReport(fqn, "quantized", desc, note, nbytes, qweight.packed_nbytes()), qweight


def _swap_weight(holders: list[_Holder], weight: AffineQuantizedTensor, device) -> None:
    # one object for every holder: the tie survives. GPT-2's Conv1D holds the transposed view (weight_modules.py)
    param = nn.Parameter(stored_weight(holders[0].module, weight), requires_grad=False)
    for h in holders:
        setattr(h.module, h.attr, param)
        bias = getattr(h.module, "bias", None) if is_linear_like(h.module) else None
        if device is not None and bias is not None:
            h.module.bias = nn.Parameter(bias.detach().to(device), requires_grad=bias.requires_grad)
        patch_extra_repr(h.module)


def patch_extra_repr(module: nn.Module) -> None:
    """Make ``print(model)`` show the format of ``module``'s quantized weight. The patch is a functools.partial
    of a module-level function, not a bound method, so ``torch.save(model)`` pickles it by reference."""
    module.extra_repr = functools.partial(quantized_extra_repr, module)


def quantized_extra_repr(module: nn.Module) -> str:
    """The module class's own extra_repr, plus the weight's qdtype, block size, layout and activation spec."""
    text, w = type(module).extra_repr(module), getattr(module, "weight", None)
    if not isinstance(w, AffineQuantizedTensor):
        return text
    act = "" if w.act_quant is None else f", act={w.act_quant}"
    return f"{text}, weight={w.qdtype.name} block={w.block_size} {w.qlayout}{act}"
