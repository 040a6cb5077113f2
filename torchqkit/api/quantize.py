"""quantize_: swap nn.Linear weights for AffineQuantizedTensors in place.

Two phases, so a failure leaves the model as it was: (1) plan and quantize every selected weight
without touching the model; (2) swap the parameters and patch ``extra_repr``. Shared steps live here
once; a config's handler only turns one float weight into one quantized weight.
"""
from __future__ import annotations

import types
import warnings
from typing import Callable

import torch
from torch import nn

from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .configs.base import QuantConfig, handler_for
from .module_configs import ModuleConfigs
from .quantize_weight import UnsupportedWeight
from .report import LayerReport, QuantizationReport

__all__ = ["quantize_", "QuantizationError"]


class QuantizationError(ValueError):
    """Raised by quantize_(..., strict=True) when a selected layer can't be quantized."""


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def quantize_(model: nn.Module, config, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
              device=None, strict: bool = False) -> QuantizationReport:
    """Quantize the weights of ``model``'s Linear layers in place and report what happened to each.

    config: a QuantConfig (every selected Linear) or a ModuleConfigs (per-module configs).
    filter_fn(module, fqn): which modules to consider; default: every nn.Linear.
    device: quantize (and leave) the selected layers on this device.
    strict: raise QuantizationError instead of reporting layers that can't be quantized.
    """
    configs = _as_module_configs(config)
    for c in configs.configs.values():
        if c is not None:
            handler_for(c)  # unknown config types fail before anything happens
    modules = dict(model.named_modules())
    exact = set(configs.exact_keys())
    entries, swaps = [], []
    for fqn, module in modules.items():
        if not (fqn in exact or (filter_fn or _default_filter)(module, fqn)):
            continue
        entry, new_weight = _plan_layer(fqn, module, configs, device)
        entries.append(entry)
        if new_weight is not None:
            swaps.append((module, new_weight))
    for key in sorted(exact - modules.keys()):
        entries.append(LayerReport(key, "skipped", "-", "ModuleConfigs names a module the model does not have", 0, 0))
    report = QuantizationReport(entries)
    problems = report.skipped
    if problems and strict:
        raise QuantizationError("quantize_(strict=True): the model was left unchanged because "
                                + "; ".join(f"{e.fqn}: {e.reason}" for e in problems))
    for module, weight in swaps:
        _swap_weight(module, weight, device)
    if problems:
        warnings.warn(f"torchqkit.quantize_: {len(problems)} selected layer(s) left unquantized: "
                      + "; ".join(f"{e.fqn} ({e.reason})" for e in problems[:5])
                      + (" ..." if len(problems) > 5 else "") + ". See the returned report; strict=True raises.",
                      stacklevel=2)
    return report


def _as_module_configs(config) -> ModuleConfigs:
    if isinstance(config, ModuleConfigs):
        return config
    if isinstance(config, QuantConfig):
        return ModuleConfigs({"_default": config})
    handler_for(config)  # raises a TypeError listing the known configs
    raise AssertionError("unreachable")


def _plan_layer(fqn: str, module: nn.Module, configs: ModuleConfigs, device):
    weight = getattr(module, "weight", None)
    nbytes = weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0
    if isinstance(weight, AffineQuantizedTensor):
        nbytes = weight.packed_nbytes()
    key, config = configs.lookup(fqn)
    if key is None:
        return LayerReport(fqn, "kept", "-", "no config matched (no exact name, pattern or _default)", nbytes, nbytes), None
    if config is None:
        return LayerReport(fqn, "kept", "-", f"ModuleConfigs[{key!r}] is None", nbytes, nbytes), None
    desc = config.describe()
    if not isinstance(module, nn.Linear):
        return LayerReport(fqn, "skipped", desc, f"{type(module).__name__} is not an nn.Linear; torchqkit "
                           f"quantizes Linear weights", nbytes, nbytes), None
    if isinstance(weight, AffineQuantizedTensor):
        return LayerReport(fqn, "skipped", desc, "weight is already quantized", nbytes, nbytes), None
    if weight.is_meta:
        return LayerReport(fqn, "skipped", desc, "weight is on the meta device: load real weights first "
                           "(or load a quantized checkpoint with load_state_dict(assign=True))", nbytes, nbytes), None
    w = weight.detach() if device is None else weight.detach().to(device)
    try:
        qweight = handler_for(config)(config, w, f"{fqn}.weight")
    except UnsupportedWeight as e:
        return LayerReport(fqn, "skipped", desc, str(e), nbytes, nbytes), None
    except ValueError as e:  # numerics refused the data, e.g. NaN/Inf in the weight
        return LayerReport(fqn, "skipped", desc, str(e), nbytes, nbytes), None
    return LayerReport(fqn, "quantized", desc, "", nbytes, qweight.packed_nbytes()), qweight


def _swap_weight(module: nn.Linear, weight: AffineQuantizedTensor, device) -> None:
    module.weight = nn.Parameter(weight, requires_grad=False)
    if device is not None and module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach().to(device), requires_grad=module.bias.requires_grad)
    module.extra_repr = types.MethodType(_quantized_extra_repr, module)


def _quantized_extra_repr(self: nn.Linear) -> str:
    w = self.weight
    act = "" if w.act_quant is None else f", act={w.act_quant}"
    return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={w.qdtype.name} block={w.block_size} {w.qlayout}{act}")
