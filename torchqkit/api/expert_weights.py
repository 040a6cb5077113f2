"""Mixture-of-experts weights in quantize_: the 3-d expert Parameters and the router next to them.

Note [Expert Parameters in quantize_]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5.x keeps a MoE layer's experts in one module (``Qwen3MoeExperts``, ``MixtralExperts``, ...: a
class whose name ends in "Experts", or any module ``@use_experts_implementation`` decorated, which sets
``is_transposed``) holding 3-d Parameters ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I) (``up_proj``
without a gate) and optional 2-d ``*_bias`` Parameters, which stay float. Each 3-d ``*_proj`` Parameter is one
report entry named ``<module>.<attribute>`` (``model.layers.0.mlp.experts.gate_up_proj``), which is also its
name in ModuleConfigs; its config quantizes every expert (E weights of (N, K)) on its own and the results are
stacked (Note [Expert weights] in tensor/experts.py). A module storing them transposed (``is_transposed``: (E, K,
N)) gets a transposed stack, so the module still sees (E, K, N). filter_fn, when given, is asked with the experts
module and the entry's name.

The router (the ``gate`` or ``router`` module next to ``experts``) stays float by default: it is a tiny share of
the weights (E x H), and quantization noise in its logits changes which experts a token is sent to, a discrete
error no later layer undoes; every MoE quantizer (llama.cpp, vLLM, AutoRound, GPTQ / AWQ tooling) leaves it float.
An nn.Linear router is quantized only when ModuleConfigs names it exactly. An experts module with no router next
to it is reported as skipped with the reason (``strict=True`` raises before anything changes): the model is not
the MoE structure this code knows, and its routing can't be kept float on purpose.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from ..tensor.experts import stack_experts
from .configs.base import handler_for
from .module_configs import ModuleConfigs
from .quantize_weight import UnsupportedWeight
from .report import LayerReport

__all__ = ["ExpertPlan", "plan_experts", "expert_parameters", "experts_nk", "ROUTER_NAMES"]

ROUTER_NAMES = ("gate", "router")
ROUTER_REASON = ("router of {experts}: kept in float (quantization noise in its logits sends tokens to other "
                 "experts); name {fqn!r} in ModuleConfigs to quantize it")


class ExpertParameter(NamedTuple):
    fqn: str                 # "<module fqn>.<attribute>": the report entry and the ModuleConfigs name
    module_fqn: str
    module: nn.Module
    attr: str


class ExpertPlan(NamedTuple):
    entries: list[LayerReport]                       # one per expert Parameter and per router / missing router
    swaps: list[tuple[str, nn.Module, str, torch.Tensor]]  # (module fqn, module, attribute, quantized stack)
    names: list[str]                                 # every expert Parameter's name (ModuleConfigs may use them)
    routers: set[str]                                # router modules the Linear walk must leave alone
    anchor: dict[str, str]                           # entry fqn -> module fqn it is reported after


def is_experts_module(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Experts") or hasattr(module, "is_transposed")


def experts_nk(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight``, a stack ``module`` holds, as E weights of (N, K): a module storing them transposed
    (``is_transposed``: (E, K, N)) gets the view with its last two dims swapped, which is also the way back."""
    return weight.transpose(-2, -1) if getattr(module, "is_transposed", False) else weight


def expert_parameters(modules: dict[str, nn.Module]) -> list[ExpertParameter]:
    """Every 3-d expert Parameter of the model, in module order: see Note [Expert Parameters in quantize_]."""
    found = []
    for fqn, module in modules.items():
        if not is_experts_module(module):
            continue
        for attr, p in module._parameters.items():
            if p is not None and p.dim() == 3 and attr.endswith("_proj"):
                found.append(ExpertParameter(f"{fqn}.{attr}" if fqn else attr, fqn, module, attr))
    return found


def plan_experts(modules: dict[str, nn.Module], configs: ModuleConfigs, filter_fn, device,
                 calibrated=None) -> ExpertPlan:
    """Phase 1 for expert Parameters and their routers: report entries and the stacks to swap in. Touches nothing.
    ``calibrated``: calibrate_model's CalibrationPlan, holding the GPTQ stacks (Note [Expert calibration])."""
    params = expert_parameters(modules)
    exact = set(configs.exact_keys())
    entries, swaps, routers, anchor = [], [], set(), {}
    for module_fqn in dict.fromkeys(p.module_fqn for p in params):
        entry, router = _router_entry(modules, module_fqn, exact)
        if router is not None:
            routers.add(router)
        if entry is not None:
            entries.append(entry)
            anchor[entry.fqn] = router or module_fqn
    for p in params:
        if filter_fn is not None and p.fqn not in exact and not filter_fn(p.module, p.fqn):
            continue
        entry, stack = quantize_expert_parameter(p, configs, device, calibrated)
        entries.append(entry)
        anchor[p.fqn] = p.module_fqn
        if stack is not None:
            swaps.append((p.module_fqn, p.module, p.attr, stack))
    return ExpertPlan(entries, swaps, [p.fqn for p in params], routers, anchor)


def _router_entry(modules, experts_fqn: str, exact: set) -> tuple[LayerReport | None, str | None]:
    parent = experts_fqn.rpartition(".")[0]
    for name in ROUTER_NAMES:
        fqn = f"{parent}.{name}" if parent else name
        router = modules.get(fqn)
        if router is None:
            continue
        if fqn in exact:
            return None, None  # named: the Linear walk plans it like any module
        nbytes = sum(p.numel() * p.element_size() for p in router.parameters(recurse=False))
        return LayerReport(fqn, "kept", "-", ROUTER_REASON.format(experts=experts_fqn, fqn=fqn), nbytes, nbytes), fqn
    looked = ", ".join(f"{parent + '.' if parent else ''}{n}" for n in ROUTER_NAMES)
    return LayerReport(f"{experts_fqn}", "skipped", "-",
                       f"no router found next to the experts (looked for {looked}): torchqkit keeps a MoE router "
                       f"in float and can't tell which module routes here. Name the router in ModuleConfigs with "
                       f"None to keep it float, or pass a filter_fn that leaves {experts_fqn} out", 0, 0), None


def quantize_expert_parameter(p: ExpertParameter, configs: ModuleConfigs, device, calibrated=None):
    """(report entry, quantized stack or None) for one expert Parameter, as its config says (or as calibration
    made it: ``calibrated``, a CalibrationPlan)."""
    weight = getattr(p.module, p.attr)
    nbytes = weight.numel() * weight.element_size()
    key, config = configs.lookup(p.fqn)
    if key is None or config is None:
        why = "no config matched (no exact name, pattern or _default)" if key is None else f"ModuleConfigs[{key!r}] is None"
        return LayerReport(p.fqn, "kept", "-", why, nbytes, nbytes), None
    desc = config.describe()
    done = None if calibrated is None else calibrated.weights.get(p.fqn)
    if isinstance(done, UnsupportedWeight):
        return LayerReport(p.fqn, "skipped", desc, str(done), nbytes, nbytes), None
    if done is not None:
        return _stack_entry(p.fqn, desc, nbytes, done, calibrated.notes.get(p.fqn, "")), done
    problem = _parameter_problem(weight, config)
    if problem is not None:
        return LayerReport(p.fqn, "skipped", desc, problem, nbytes, nbytes), None
    w = weight.detach() if device is None else weight.detach().to(device)
    try:
        stack = quantize_experts(config, experts_nk(p.module, w), p.fqn)
    except (UnsupportedWeight, ValueError) as e:
        return LayerReport(p.fqn, "skipped", desc, str(e), nbytes, nbytes), None
    if getattr(p.module, "is_transposed", False):  # the module still sees (E, K, N)
        stack = stack.with_changes(transposed=True)
    return _stack_entry(p.fqn, desc, nbytes, stack), stack


def _stack_entry(fqn: str, desc: str, nbytes: int, stack, note: str = "") -> LayerReport:
    e, n, k = stack.logical_shape
    what = f"{e} experts of ({n}, {k}), {stack.packed_nbytes() // e:,} bytes each" + (f"; {note}" if note else "")
    return LayerReport(fqn, "quantized", desc, what, nbytes, stack.packed_nbytes())


def quantize_experts(config, weight: torch.Tensor, name: str):
    """A config applied to each expert of a float (E, N, K) weight on its own, stacked into one quantized tensor."""
    handler = handler_for(config)
    return stack_experts([handler(config, weight[e], f"{name}[{e}]") for e in range(weight.shape[0])], name)


def _parameter_problem(weight: torch.Tensor, config) -> str | None:
    if isinstance(weight, AffineQuantizedTensor):
        return "weight is already quantized"
    if weight.is_meta:
        return "weight is on the meta device: load real weights first"
    if config.needs_calibration_data():  # calibrate_model didn't reach it: outside the blocks, or not calibrated
        return (f"{type(config).__name__} calibrates expert Parameters inside the decoder blocks only, with the "
                f"calibration data, and this one was not calibrated; pass calibration_data (and, for experts outside "
                f"the decoder blocks, CalibrationData(blocks=...) naming the block list that holds them), or give it "
                f"a weight-only or dynamic-activation config")
    return None
