"""enable_float8_training_: train a model's Linear layers in float8 (e4m3 forward, e5m2 gradients).

    report = qk.enable_float8_training_(model, recipe="dynamic")   # or "delayed"; granularity="tensor" | "row"
    print(report)                        # every Linear: converted, or skipped and why
    print(qk.float8_training_status())   # which matmul runs on this machine and why (emulated on CPU)
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from ..api.report import LayerReport, QuantizationReport
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .fake_quantized_linear import FakeQuantizedLinear
from .float8_linear import Float8TrainingLinear, Float8TrainingState, float8_training_class
from .float8_matmul import matmul_backend

__all__ = ["enable_float8_training_", "float8_training_status", "FLOAT8_RECIPES", "FLOAT8_GRANULARITIES"]

FLOAT8_RECIPES = ("dynamic", "delayed")
FLOAT8_GRANULARITIES = ("tensor", "row")
# torch._scaled_mm needs both matmul dims of every operand to be multiples of 16; layers that aren't stay in
# float on every device, so a model trains with the same numerics on CPU and GPU.
SCALED_MM_MULTIPLE = 16


def enable_float8_training_(model: nn.Module, recipe: str = "dynamic", *, granularity: str = "tensor",
                            history_len: int = 16,
                            filter_fn: Callable[[nn.Module, str], bool] | None = None) -> QuantizationReport:
    """Make the selected ``nn.Linear`` layers train in float8 (e4m3 forward, e5m2 gradients), in place.

    Each selected layer becomes a ``Float8TrainingLinear`` (its class changes; identity, hooks and Parameters
    stay): the forward and both backward matmuls run on float8 operands, while master weights stay in float. On
    devices without float8 tensor cores the matmul is emulated (see ``float8_training_status``). Layers whose
    dimensions aren't multiples of 16 stay in float on every device and are reported (with a warning).

    Args:
        model (torch.nn.Module): the float model, changed in place.
        recipe (str): ``"dynamic"`` (default; scales from the current amax) or ``"delayed"`` (from an amax history
            of ``history_len`` steps, kept in the buffer ``fp8_amax_history``, which the state dict saves).
        granularity (str): ``"tensor"`` (default) or ``"row"`` (per-row / per-column scales; dynamic only).
            Keyword-only, as are the arguments below.
        history_len (int): steps of amax history for ``"delayed"``, >= 1; default 16.
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` selects the modules; None
            (default): every ``nn.Linear``.

    Returns:
        QuantizationReport: one entry per selected module: ``"quantized"`` (trains in float8) or ``"skipped"``
            with the reason.

    Raises:
        ValueError: an unknown recipe or granularity, ``"delayed"`` with ``"row"``, a bad ``history_len``, or a
            selected layer that is quantized, QAT-prepared or already in float8 (the model is left unchanged).

    Example:
        ```python
        import torchqkit as qk
        report = qk.enable_float8_training_(model, recipe="dynamic", granularity="row")
        print(report)                          # every Linear: converted, or skipped and why
        ```
    """
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"enable_float8_training_: recipe must be one of {list(FLOAT8_RECIPES)}, got {recipe!r}")
    if granularity not in FLOAT8_GRANULARITIES:
        raise ValueError(f"enable_float8_training_: granularity must be one of {list(FLOAT8_GRANULARITIES)}, "
                         f"got {granularity!r}")
    if recipe == "delayed" and granularity != "tensor":
        raise ValueError("enable_float8_training_: delayed scaling keeps one amax history per tensor; use "
                         "granularity='tensor' with recipe='delayed', or recipe='dynamic' for row scales")
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"enable_float8_training_: history_len must be an int >= 1, got {history_len!r}")
    selected = filter_fn or (lambda m, fqn: isinstance(m, nn.Linear))
    entries, chosen = [], []
    desc = f"float8 training {recipe} {granularity} (e4m3 / e5m2)"
    for fqn, module in model.named_modules():
        if not selected(module, fqn):
            continue
        reason = _refusal(fqn, module)
        nbytes = 0 if getattr(module, "weight", None) is None else module.weight.numel() * module.weight.element_size()
        if reason is not None:
            entries.append(LayerReport(fqn, "skipped", desc, reason, nbytes, nbytes))
        else:
            entries.append(LayerReport(fqn, "quantized", desc, "", nbytes, nbytes))
            chosen.append(module)
    for module in chosen:  # every check is done: nothing below fails
        if recipe == "delayed":
            module.register_buffer("fp8_amax_history", torch.zeros(3, history_len, device=module.weight.device))
        module.fp8 = Float8TrainingState(recipe, granularity, type(module))
        module.__class__ = float8_training_class(type(module))
    report = QuantizationReport(entries)
    if report.skipped:
        warnings.warn(f"torchqkit.enable_float8_training_: {len(report.skipped)} layer(s) stay in float: "
                      + "; ".join(f"{e.fqn} ({e.reason})" for e in report.skipped[:5])
                      + (" ..." if len(report.skipped) > 5 else ""), stacklevel=2)
    return report


def _refusal(fqn: str, module: nn.Module) -> str | None:
    """Why a selected module can't train in float8 (a skip), or None. Raises for states that must not mix."""
    if isinstance(module, (Float8TrainingLinear, FakeQuantizedLinear)):
        what = "trains in float8 already" if isinstance(module, Float8TrainingLinear) else "is prepared for QAT"
        raise ValueError(f"enable_float8_training_: {fqn} {what}; the model was left unchanged. Start from the "
                         f"float model")
    if not isinstance(module, nn.Linear):
        return f"{type(module).__name__} is not an nn.Linear"
    if isinstance(module.weight, AffineQuantizedTensor):
        raise ValueError(f"enable_float8_training_: {fqn}.weight is quantized ({module.weight.qdtype.name}); float8 "
                         f"training needs float master weights. The model was left unchanged")
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has its own forward, which float8 training would replace"
    if not module.weight.dtype.is_floating_point:
        return f"weight dtype {module.weight.dtype} is not floating point"
    n, k = module.weight.shape
    if n % SCALED_MM_MULTIPLE or k % SCALED_MM_MULTIPLE:
        return (f"weight {n}x{k}: torch._scaled_mm needs both dims to be multiples of {SCALED_MM_MULTIPLE}, so it "
                f"stays in float on every device")
    return None


def float8_training_status(device: str | torch.device = "cpu") -> dict:
    """Which matmul float8 training runs on ``device``, and why.

    On a CUDA GPU with compute capability >= 8.9 it is ``torch._scaled_mm`` on float8 tensor cores; elsewhere the
    float8 casts are exact and the product of the dequantized values runs in float32 (``"emulated"``).

    Args:
        device (str | torch.device): the device to ask about; default ``"cpu"``.

    Returns:
        dict: ``{"device": str, "path": str, "why": str}``; ``path`` names the backend (``"emulated"`` on CPU).

    Example:
        ```python
        import torchqkit as qk
        status = qk.float8_training_status("cuda")
        print(status["path"], "-", status["why"])
        ```
    """
    device = torch.device(device)
    path, why = matmul_backend(device)
    return {"device": str(device), "path": path, "why": why}
