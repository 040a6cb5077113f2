"""enable_float8_training_: train a model's Linear layers in float8 (e4m3 forward, e5m2 or e4m3 gradients).

    report = qk.enable_float8_training_(model, recipe="dynamic")   # or "delayed"; granularity="tensor" | "row"
    print(report)                        # every Linear: converted, or skipped and why
    qk.enable_float8_training_(model2, "dynamic", grad_dtype="float8_e4m3fn")   # e4m3 gradients
    qk.enable_float8_training_(model3, "static")         # fixed scales, set by a calibration pass:
    with qk.float8_training_calibration(model3):          #   a few forward + backward passes in here
        train_steps(model3)
    print(qk.float8_training_status())   # which matmul runs on this machine and why (emulated on CPU)
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from ..api.report import LayerReport, QuantizationReport
from ..core.qdtype import QDType
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .fake_quantized_linear import FakeQuantizedLinear
from .float8_linear import Float8TrainingLinear, Float8TrainingState, float8_training_class
from .float8_matmul import matmul_backend
from .float8_static import TENSORS, Float8StaticScales

__all__ = ["enable_float8_training_", "float8_training_status", "FLOAT8_RECIPES", "FLOAT8_GRANULARITIES",
           "FLOAT8_GRAD_DTYPES"]

FLOAT8_RECIPES = ("dynamic", "delayed", "static")
FLOAT8_GRANULARITIES = ("tensor", "row")
FLOAT8_GRAD_DTYPES = ("float8_e5m2", "float8_e4m3fn")
# torch._scaled_mm needs both matmul dims of every operand to be multiples of 16; layers that aren't stay in
# float on every device, so a model trains with the same numerics on CPU and GPU.
SCALED_MM_MULTIPLE = 16


def enable_float8_training_(model: nn.Module, recipe: str = "dynamic", *, granularity: str = "tensor",
                            grad_dtype: str | QDType = "float8_e5m2", history_len: int = 16,
                            static_scales: Float8StaticScales | dict[str, Float8StaticScales] | None = None,
                            filter_fn: Callable[[nn.Module, str], bool] | None = None) -> QuantizationReport:
    """Make the selected ``nn.Linear`` layers train in float8 (e4m3 forward, e5m2 or e4m3 gradients), in place.

    Each selected layer becomes a ``Float8TrainingLinear`` (its class changes; identity, hooks and Parameters
    stay): the forward and both backward matmuls run on float8 operands, while master weights stay in float. On
    devices without float8 tensor cores the matmul is emulated (see ``float8_training_status``). Layers whose
    dimensions aren't multiples of 16 stay in float on every device and are reported (with a warning).

    Args:
        model (torch.nn.Module): the float model, changed in place.
        recipe (str): ``"dynamic"`` (default; scales from the current amax), ``"delayed"`` (from an amax history
            of ``history_len`` steps, kept in the buffer ``fp8_amax_history``, which the state dict saves) or
            ``"static"`` (three fixed per-tensor scales per layer, input / weight / grad_output, buffer
            ``fp8_static_scales``: from ``static_scales`` or from a calibration pass, ``float8_training_calibration``;
            values past them saturate and ``float8_training_overflows`` reports it).
        granularity (str): ``"tensor"`` (default) or ``"row"`` (per-row / per-column scales; dynamic only).
            Keyword-only, as are the arguments below.
        grad_dtype (str | QDType): the format of the output gradients in the backward matmuls:
            ``"float8_e5m2"`` (default: range) or ``"float8_e4m3fn"`` (precision; scaled by its own amax, history or
            static scale like the other operands), or the qdtype.
        history_len (int): steps of amax history for ``"delayed"``, >= 1; default 16.
        static_scales (Float8StaticScales | dict[str, Float8StaticScales] | None): ``"static"`` only: the scales of
            every converted layer, or a dict from layer name to scales naming every converted layer; None (default):
            set later by ``float8_training_calibration`` (a static layer without scales refuses to run).
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` selects the modules; None
            (default): every ``nn.Linear``.

    Returns:
        QuantizationReport: one entry per selected module: ``"quantized"`` (trains in float8) or ``"skipped"``
            with the reason.

    Raises:
        ValueError: an unknown recipe, granularity or gradient format, ``"delayed"`` / ``"static"`` with ``"row"``, a
            bad ``history_len``, ``static_scales`` without ``"static"`` or not naming exactly the converted layers,
            or a selected layer that is quantized, QAT-prepared or already in float8 (the model is left unchanged).

    Example:
        ```python
        import torchqkit as qk
        report = qk.enable_float8_training_(model, recipe="dynamic", granularity="row")
        print(report)                          # every Linear: converted, or skipped and why
        qk.enable_float8_training_(other_model, "dynamic", grad_dtype="float8_e4m3fn")   # e4m3 gradients
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
    if recipe == "static" and granularity != "tensor":
        raise ValueError("enable_float8_training_: static scaling keeps one scale per tensor; use "
                         "granularity='tensor' with recipe='static', or recipe='dynamic' for row scales")
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"enable_float8_training_: history_len must be an int >= 1, got {history_len!r}")
    grad_name = grad_dtype.name if isinstance(grad_dtype, QDType) else grad_dtype
    if grad_name not in FLOAT8_GRAD_DTYPES:
        raise ValueError(f"enable_float8_training_: grad_dtype must be one of {list(FLOAT8_GRAD_DTYPES)} (the float8 "
                         f"formats training's matmuls take), got {grad_dtype!r}")
    if static_scales is not None and recipe != "static":
        raise ValueError(f"enable_float8_training_: static_scales are the scales of recipe='static', not of "
                         f"recipe={recipe!r}; pass recipe='static' or drop static_scales")
    if static_scales is not None and not isinstance(static_scales, (Float8StaticScales, dict)):
        raise TypeError(f"enable_float8_training_: static_scales must be a Float8StaticScales or a dict from layer "
                        f"name to Float8StaticScales, got {type(static_scales).__name__}")
    selected = filter_fn or (lambda m, fqn: isinstance(m, nn.Linear))
    entries, chosen = [], []
    desc = f"float8 training {recipe} {granularity} (e4m3 / {grad_name.removeprefix('float8_').removesuffix('fn')})"
    for fqn, module in model.named_modules():
        if not selected(module, fqn):
            continue
        reason = _refusal(fqn, module)
        nbytes = 0 if getattr(module, "weight", None) is None else module.weight.numel() * module.weight.element_size()
        if reason is not None:
            entries.append(LayerReport(fqn, "skipped", desc, reason, nbytes, nbytes))
        else:
            entries.append(LayerReport(fqn, "quantized", desc, "", nbytes, nbytes))
            chosen.append((fqn, module))
    scales = _layer_scales(static_scales, [fqn for fqn, _ in chosen])
    for fqn, module in chosen:  # every check is done: nothing below fails
        device = module.weight.device
        if recipe == "delayed":
            module.register_buffer("fp8_amax_history", torch.zeros(3, history_len, device=device))
        if recipe == "static":  # Note [Static float8 training scales]
            given = scales.get(fqn)
            module.register_buffer("fp8_static_scales", torch.zeros(len(TENSORS), device=device) if given is None
                                   else given.as_tensor(device))
            module.register_buffer("fp8_overflow", torch.zeros(len(TENSORS), 3, dtype=torch.float64, device=device),
                                   persistent=False)
        module.fp8 = Float8TrainingState(recipe, granularity, type(module), grad_name, fqn,
                                         static_ready=recipe == "static" and fqn in scales)
        module.__class__ = float8_training_class(type(module))
    report = QuantizationReport(entries)
    if report.skipped:
        warnings.warn(f"torchqkit.enable_float8_training_: {len(report.skipped)} layer(s) stay in float: "
                      + "; ".join(f"{e.fqn} ({e.reason})" for e in report.skipped[:5])
                      + (" ..." if len(report.skipped) > 5 else ""), stacklevel=2)
    return report


def _layer_scales(static_scales, names: list[str]) -> dict[str, Float8StaticScales]:
    """The given static scales of each converted layer, by name; a dict must name exactly the converted layers."""
    if static_scales is None:
        return {}
    if isinstance(static_scales, Float8StaticScales):
        return dict.fromkeys(names, static_scales)
    bad = [k for k, v in static_scales.items() if not isinstance(v, Float8StaticScales)]
    if bad:
        raise TypeError(f"enable_float8_training_: static_scales[{bad[0]!r}] must be a Float8StaticScales, got "
                        f"{type(static_scales[bad[0]]).__name__}")
    missing, unknown = [n for n in names if n not in static_scales], [k for k in static_scales if k not in names]
    if missing or unknown:
        raise ValueError(f"enable_float8_training_: static_scales must name exactly the converted layers; "
                         + (f"missing: {missing[:8]}" if missing else "")
                         + ("; " if missing and unknown else "")
                         + (f"not converted (no such Linear, not selected, or skipped): {unknown[:8]}" if unknown
                            else "")
                         + ". The model was left unchanged")
    return dict(static_scales)


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
