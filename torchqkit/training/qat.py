"""prepare_qat_ / convert_qat_: quantization-aware training on the float model, then real quantization.

    qk.prepare_qat_(model, qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32)))
    train(model)                       # float weights, fake-quantized in the forward, STE backward
    report = qk.convert_qat_(model)    # quantize_ with the same configs: the same weights, bit for bit

prepare_qat_ plans with ``plan_quantize`` (quantize_'s own first phase), so it fake-quantizes exactly the
layers convert_qat_ will quantize, with the same per-module configs, tied-weight rules and report.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from ..api.configs.base import recipe_for
from ..api.expert_weights import expert_parameters
from ..api.module_configs import ModuleConfigs
from ..api.quantize import QuantizationError, as_module_configs, plan_quantize, quantize_
from ..api.report import QuantizationReport
from ..core.qdtype import QKind
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .fake_quantize import WeightFakeQuantizer
from .fake_quantized_experts import (ExpertsQATState, ExpertWeightQAT, FakeQuantizedExperts,
                                     fake_quantized_experts_class)
from .fake_quantized_linear import FakeQuantizedLinear, QATState, fake_quantized_class
from .qat_config import QATConfig
from .sparse_training import SparseTrainingLinear, prepare_sparse_qat

__all__ = ["prepare_qat_", "convert_qat_", "is_qat_prepared"]


def prepare_qat_(model: nn.Module, config: QATConfig, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
                 strict: bool = False) -> QuantizationReport:
    """Make ``model``'s Linear layers and expert stacks train through fake quantization towards ``config.base``,
    in place.

    Each selected Linear becomes a ``FakeQuantizedLinear`` (its class changes; identity, hooks, Parameters and
    state-dict keys stay), whose forward fake-quantizes the weight exactly as ``quantize_`` would store it. The 3-d
    expert Parameters of a mixture-of-experts model (``...mlp.experts.gate_up_proj``, one report entry and
    ModuleConfigs name each, as in ``quantize_``) train the same way: their experts module becomes a
    ``FakeQuantizedExperts``, whose forward reads each stack fake-quantized expert by expert, under every
    transformers experts implementation (Note [Fake-quantized experts]); a config that also quantizes activations
    leaves them float (reported as skipped). It plans with ``quantize_``'s own first phase, so it selects exactly
    the layers ``convert_qat_`` will quantize, with the same per-module configs and tied-weight rules. Train the
    model as usual, then call ``convert_qat_``.
    On a model ``prepare_sparse_`` prepared, the sparse layers instead train towards their SparsityConfig's
    ``base`` (``config.base`` must equal it) under their N:M masks, and ``convert_sparse_`` converts them (Note
    [Sparse quantization-aware training]); the other layers stay float.

    Args:
        model (torch.nn.Module): the float model, changed in place.
        config (QATConfig): what to train towards.
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` selects the modules (for an
            expert stack: its experts module and the stack's name); None (default): every ``nn.Linear`` and expert
            stack. Keyword-only.
        strict (bool): raise ``QuantizationError`` (changing nothing) if a selected layer can't be quantized by the
            config, instead of reporting and warning; default False. Keyword-only.

    Returns:
        QuantizationReport: the report ``quantize_`` would give for ``config.base`` (``"quantized"`` means
            fake-quantized now, quantized by ``convert_qat_``); layers and expert stacks it can't train are
            ``"skipped"`` with the reason.

    Raises:
        TypeError: ``config`` is not a ``QATConfig``, or a config a fake quantizer can't emulate (no per-weight
            recipe).
        ValueError: the model holds quantized weights or was already prepared, stochastic rounding with a
            non-integer format, or a weight tied to a module that isn't a plain Linear (model left unchanged).
        QuantizationError: with ``strict=True``, a selected layer or expert stack the config can't take or
            fake quantization can't train (an expert stack under an activation-quantizing config).

    Example:
        ```python
        import torchqkit as qk
        qk.prepare_qat_(model, qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32)))
        train(model)                        # float weights, fake-quantized in the forward
        report = qk.convert_qat_(model)     # the same weights, quantized
        ```
    """
    if not isinstance(config, QATConfig):
        raise TypeError(f"prepare_qat_ takes a QATConfig, got {type(config).__name__}"
                        + (f"; wrap it: QATConfig({type(config).__name__}(...))" if hasattr(config, "describe") else ""))
    modules = dict(model.named_modules())
    # sparse-prepared layers train towards their SparsityConfig's base: Note [Sparse quantization-aware training]
    if any(isinstance(m, SparseTrainingLinear) for m in modules.values()):
        return prepare_sparse_qat(model, config, filter_fn)
    _refuse_quantized_or_prepared(modules)
    configs = as_module_configs(config.base)
    _check_emulable(configs, modules, filter_fn, config.stochastic_rounding)
    report, swaps = plan_quantize(model, configs, filter_fn=filter_fn)
    swaps = _trainable_swaps(report, swaps)
    if report.skipped and strict:
        raise QuantizationError("prepare_qat_(strict=True): the model was left unchanged because "
                                + "; ".join(f"{e.fqn}: {e.reason}" for e in report.skipped))
    plans = []
    for swap in swaps:
        if swap.weight.dim() == 3:  # one expert stack: Note [Fake-quantized experts]
            (h,) = swap.holders
            plans.append((swap.holders, configs.lookup(_stack_name(h.fqn, h.attr))[1], True))
            continue
        # The planned Linear that owns the weight (holders run in module order: an embedding may come first).
        owner = next(h.fqn for h in swap.holders if report[h.fqn].status == "quantized")
        for h in swap.holders:
            _check_holder(h.fqn, h.module, h.attr, owner)
        plans.append((swap.holders, configs.lookup(owner)[1], False))
    clipped = config.grad == "clipped_ste"
    experts: dict[nn.Module, dict[str, ExpertWeightQAT]] = {}
    for index, (holders, base, stack) in enumerate(plans):  # nothing above changed the model; from here nothing fails
        generator = torch.Generator().manual_seed(config.seed + index) if config.stochastic_rounding else None
        quantizer = WeightFakeQuantizer(recipe_for(base), clipped=clipped, generator=generator,
                                        name=f"{holders[0].fqn}.{holders[0].attr}")
        if stack:  # its experts module changes class once all of its stacks are known
            experts.setdefault(holders[0].module, {})[holders[0].attr] = ExpertWeightQAT(base, quantizer)
            continue
        for h in holders:
            h.module.qat = QATState(base, type(h.module), quantizer, clipped)
            h.module.__class__ = fake_quantized_class(type(h.module))
    for module, weights in experts.items():
        module.qat = ExpertsQATState(type(module), weights, clipped)
        module.__class__ = fake_quantized_experts_class(type(module), weights)
    if report.skipped:
        warnings.warn(f"torchqkit.prepare_qat_: {len(report.skipped)} selected layer(s) stay in float (convert_qat_ "
                      f"won't quantize them either): "
                      + "; ".join(f"{e.fqn} ({e.reason})" for e in report.skipped[:5])
                      + (" ..." if len(report.skipped) > 5 else "") + ". strict=True raises.", stacklevel=2)
    return report


def _trainable_swaps(report, swaps):
    """The planned swaps QAT can train: Linear weights and the 3-d expert stacks of MoE models (Note [Fake-quantized
    experts]). The others' report entries become "skipped" with the reason: expert stacks under a config that
    quantizes activations too (their inputs are made inside the experts' forward), GPT-2's Conv1D, 1x1
    convolutions and standalone embeddings (Note [Weight-bearing modules]); quantize_ quantizes them after
    training."""
    kept = []
    for swap in swaps:
        if swap.weight.dim() == 3:
            if swap.weight.act_quant is None:
                kept.append(swap)
                continue
            entries = [report[_stack_name(h.fqn, h.attr)] for h in swap.holders]
            reason = ("quantization-aware training fake-quantizes expert stacks' weights, not the activations this "
                      "config also quantizes inside the experts' forward; give the experts a weight-only config "
                      "(ModuleConfigs with a 're:.*experts.*' key), or quantize them after training with quantize_")
        else:
            owner = next(h for h in swap.holders if report[h.fqn].status == "quantized")
            if isinstance(owner.module, nn.Linear):
                kept.append(swap)
                continue
            entries = [report[owner.fqn]]
            reason = (f"quantization-aware training fake-quantizes nn.Linear weights and expert stacks, not "
                      f"{type(owner.module).__name__} weights yet; quantize them after training with quantize_ (a "
                      f"ModuleConfigs naming them)")
        for entry in entries:
            entry.status, entry.bytes_after, entry.reason = "skipped", entry.bytes_before, reason
    return kept


def _stack_name(module_fqn: str, attr: str) -> str:
    """An expert stack's report entry and ModuleConfigs name, as expert_parameters gives it."""
    return f"{module_fqn}.{attr}" if module_fqn else attr


def convert_qat_(model: nn.Module) -> QuantizationReport:
    """Quantize every layer and expert stack ``prepare_qat_`` fake-quantized, with its config, and restore each
    module's class, in place.

    The quantized weights (for expert stacks: the (E, N, K) stacks ``quantize_`` stores) dequantize to the last
    training forward's fake-quantized weights bit for bit (with round-to-nearest; stochastic rounding trains around
    them). Experts modules become the transformers classes they were.

    Args:
        model (torch.nn.Module): a model prepared by ``prepare_qat_`` (and trained).

    Returns:
        QuantizationReport: ``quantize_``'s report for the converted layers.

    Raises:
        ValueError: no layer of the model was prepared.
        QuantizationError: a prepared layer can't be quantized; the model is left as prepared.

    Example:
        ```python
        import torchqkit as qk
        qk.prepare_qat_(model, qk.QATConfig(qk.Int8DynamicActivationInt8WeightConfig()))
        train(model)
        print(qk.convert_qat_(model))
        ```
    """
    prepared = {fqn: m for fqn, m in model.named_modules()
                if isinstance(m, (FakeQuantizedLinear, FakeQuantizedExperts))}
    sparse = [fqn for fqn, m in model.named_modules() if isinstance(m, SparseTrainingLinear) and m.sparse.quantizer]
    if sparse and not prepared:
        raise ValueError(f"convert_qat_: {sparse[0]}{' and others' if len(sparse) > 1 else ''} train sparse and "
                         f"quantization-aware (prepare_sparse_, then prepare_qat_); convert_sparse_(model) stores "
                         f"them in NMSparseLayout with their base config")
    if not prepared:
        raise ValueError("convert_qat_: no layer of this model was prepared for quantization-aware training; call "
                         "prepare_qat_(model, QATConfig(...)) before training, then convert_qat_(model)")
    named = {}  # Linears by module name, expert stacks by "<module>.<attribute>" (as quantize_ names them)
    for fqn, m in prepared.items():
        if isinstance(m, FakeQuantizedExperts):
            named.update({_stack_name(fqn, attr): w.config for attr, w in m.qat.weights.items()})
        else:
            named[fqn] = m.qat.config
    try:
        report = quantize_(model, ModuleConfigs(named), filter_fn=lambda module, fqn: fqn in named, strict=True)
    except QuantizationError as e:
        raise QuantizationError(f"convert_qat_: the model was left as prepared (still fake-quantized) because "
                                f"{str(e).split('because ', 1)[-1]}") from None
    for m in prepared.values():
        m.__class__ = m.qat.original_class
        del m.qat
    return report


def is_qat_prepared(model: nn.Module) -> bool:
    return any(isinstance(m, (FakeQuantizedLinear, FakeQuantizedExperts)) for m in model.modules())


def _refuse_quantized_or_prepared(modules: dict[str, nn.Module]) -> None:
    for fqn, module in modules.items():
        if isinstance(module, (FakeQuantizedLinear, FakeQuantizedExperts)):
            configs = ([module.qat.config] if isinstance(module, FakeQuantizedLinear)
                       else [w.config for w in module.qat.weights.values()])
            raise ValueError(f"prepare_qat_: {fqn or 'the model'} is already prepared for quantization-aware training "
                             f"({configs[0].describe()}); train it and call convert_qat_, or start again from "
                             f"the float model")
        for attr, p in module._parameters.items():
            if isinstance(p, AffineQuantizedTensor):
                raise ValueError(f"prepare_qat_: {fqn}.{attr} is already quantized ({p.qdtype.name}, "
                                 f"{p.qlayout.name}); quantization-aware training trains float weights: prepare the "
                                 f"float model, train it, then convert_qat_")


def _check_emulable(configs: ModuleConfigs, modules: dict[str, nn.Module], filter_fn, stochastic: bool) -> None:
    """Every config that selects a module must have a per-weight recipe (and an integer format for stochastic
    rounding); the error names the modules it would have applied to."""
    chosen: dict[str, list[str]] = {}
    for fqn, module in modules.items():
        if fqn in configs.configs or (filter_fn or (lambda m, f: isinstance(m, nn.Linear)))(module, fqn):
            key, cfg = configs.lookup(fqn)
            if cfg is not None:
                chosen.setdefault(key, []).append(fqn)
    for p in expert_parameters(modules):  # selected as plan_experts selects them
        if p.fqn in configs.configs or filter_fn is None or filter_fn(p.module, p.fqn):
            key, cfg = configs.lookup(p.fqn)
            if cfg is not None:
                chosen.setdefault(key, []).append(p.fqn)
    for key, fqns in chosen.items():
        cfg = configs.configs[key]
        where = f"{', '.join(fqns[:3])}{' ...' if len(fqns) > 3 else ''}"
        try:
            recipe = recipe_for(cfg)
        except TypeError as e:
            raise TypeError(f"prepare_qat_: a fake quantizer can't emulate the config for {where} "
                            f"({type(cfg).__name__}): {e}") from None
        if stochastic and recipe.qdtype.kind is not QKind.INT:
            raise ValueError(f"prepare_qat_: stochastic_rounding rounds integer codes; the config for {where} "
                             f"({cfg.describe()}) has {recipe.qdtype.name} codes. Use stochastic_rounding=False")


def _check_holder(fqn: str, module: nn.Module, attr: str, owner: str) -> None:
    if not isinstance(module, nn.Linear) or attr != "weight":
        raise ValueError(f"prepare_qat_: {owner}.weight is tied to {fqn}.{attr} ({type(module).__name__}), which "
                         f"would read the quantized weight after convert_qat_ but the float one while training; "
                         f"leave {owner} out of the config (ModuleConfigs({{{owner!r}: None, ...}})) or untie them")
    if type(module).forward is not nn.Linear.forward:
        raise ValueError(f"prepare_qat_: {fqn} is a {type(module).__name__} with its own forward; fake quantization "
                         f"replaces nn.Linear.forward, so it can't train it. Leave it out with filter_fn or "
                         f"ModuleConfigs({{{fqn!r}: None, ...}})")
