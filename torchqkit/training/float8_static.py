"""Static float8 training scales (Note [Static float8 training scales] in float8_linear.py): the scales a user gives
(Float8StaticScales), the calibration pass that sets them (float8_training_calibration) and the report of what
saturated (float8_training_overflows)."""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..core.qdtype import float8_e4m3fn, qdtype_from_name
from .float8_linear import GRAD, W, X, Float8TrainingLinear

__all__ = ["Float8StaticScales", "float8_training_calibration", "float8_training_overflows", "static_layers"]

TENSORS = ("input", "weight", "grad_output")  # the order of fp8_static_scales and fp8_overflow's rows


@dataclass(frozen=True)
class Float8StaticScales:
    """Fixed per-tensor scales for float8 training with ``recipe="static"``: x ~ float8(x / scale) * scale.

    A tensor's values past ``scale * max`` of its format (448 for the e4m3 input and weight; 57344 for e5m2
    gradients, 448 for e4m3 ones) saturate at that max, and ``float8_training_overflows`` counts them. A scale is
    typically ``amax / max`` of the values the tensor takes, with some headroom.

    Args:
        input (float): the scale of the layer's input (its activations), a finite number > 0.
        weight (float): the scale of the weight, a finite number > 0.
        grad_output (float): the scale of the gradient of the layer's output, a finite number > 0.

    Raises:
        ValueError: a scale that is not a finite number > 0.

    Example:
        ```python
        import torchqkit as qk
        scales = qk.Float8StaticScales(input=8.0 / 448, weight=0.5 / 448, grad_output=1e-3 / 57344)
        qk.enable_float8_training_(model, "static", static_scales=scales)          # every layer
        qk.enable_float8_training_(other, "static", static_scales={"proj": scales})  # per layer name
        ```
    """
    input: float
    weight: float
    grad_output: float

    def __post_init__(self):
        for name in TENSORS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Float8StaticScales: {name} must be a finite number > 0, got {v!r}")

    def as_tensor(self, device) -> torch.Tensor:
        return torch.tensor([self.input, self.weight, self.grad_output], dtype=torch.float32, device=device)


def static_layers(model: nn.Module) -> list[tuple[str, Float8TrainingLinear]]:
    """(name, layer) of every Float8TrainingLinear of ``model`` with recipe "static"."""
    return [(fqn, m) for fqn, m in model.named_modules()
            if isinstance(m, Float8TrainingLinear) and m.fp8.recipe == "static"]


@contextmanager
def float8_training_calibration(model: nn.Module, *, margin: float = 1.0) -> Iterator[None]:
    """Set the scales of the static float8 training recipe from a calibration pass.

    Inside the ``with`` block every layer enabled with ``enable_float8_training_(model, "static")`` runs its float
    matmul and records the largest magnitude (amax) of its input, its weight and its output gradient; run a few
    training steps' forward and backward passes there (the optimizer step is up to you: the calibration is about
    the tensors' ranges). On leaving the block each layer's scales become ``margin * amax / max`` of the tensor's
    float8 format (Note [Static float8 training scales]) and its saturation counts start from zero. Calling it again
    calibrates again.

    Args:
        model (torch.nn.Module): a model with layers enabled with ``recipe="static"``.
        margin (float): headroom on the observed amax, a finite number > 0 (> 1 leaves room for larger values before
            they saturate); keyword-only; default 1.0.

    Yields:
        None: the block runs with the static layers recording (a context manager: ``with ...:``).

    Raises:
        ValueError: no static layer in ``model``, a bad ``margin``, or (on leaving the block) layers that saw no
            forward or no backward pass inside it, named; their scales are left as they were.

    Example:
        ```python
        import torchqkit as qk
        qk.enable_float8_training_(model, "static", grad_dtype="float8_e4m3fn")
        with qk.float8_training_calibration(model, margin=2.0):
            for x, y in calibration_batches:
                loss_fn(model(x), y).backward()
        model.zero_grad()
        ```
    """
    layers = static_layers(model)
    if not layers:
        raise ValueError("float8_training_calibration: the model has no layer trained with recipe='static'; call "
                         "enable_float8_training_(model, 'static') first")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"float8_training_calibration: margin must be a finite number > 0, got {margin!r}")
    for _, m in layers:
        m.fp8.calibration_amax = torch.zeros(3, dtype=torch.float32, device=m.weight.device)
    try:
        yield
        amax = {fqn: m.fp8.calibration_amax for fqn, m in layers}
    finally:
        for _, m in layers:
            m.fp8.calibration_amax = None
    missing = [f"{fqn} ({', '.join(TENSORS[i] for i in range(3) if not a[i] > 0)})"
               for fqn, a in amax.items() if not bool((a > 0).all() & a.isfinite().all())]
    if missing:
        raise ValueError(f"float8_training_calibration: {len(missing)} layer(s) saw no (or no finite) values of: "
                         + "; ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
                         + ". Run forward and backward passes that reach them inside the `with` block (a zero weight "
                           "needs static_scales= instead); their scales were left unchanged")
    for fqn, m in layers:
        fmax = torch.tensor([float8_e4m3fn.max_abs_level, float8_e4m3fn.max_abs_level,
                             qdtype_from_name(m.fp8.grad_dtype).max_abs_level], device=m.weight.device)
        with torch.no_grad():
            m.fp8_static_scales.copy_(amax[fqn] * margin / fmax)
            m.fp8_overflow.zero_()
        m.fp8.static_ready = True


def float8_training_overflows(model: nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """What the static float8 training scales of ``model`` saturated since they were set.

    For each layer trained with ``recipe="static"`` and each of its tensors (``"input"``, ``"weight"``,
    ``"grad_output"``): ``"casts"``, the casts in which some value passed ``scale * max`` and saturated at the
    format's max; ``"elements"``, how many values saturated; ``"peak"``, the largest amax seen as a multiple of
    ``scale * max`` (above 1: saturated; NaN if a tensor held NaN). Layers without saturation are included (zeros),
    so the result also lists what was watched. The counts are buffers of each layer (``fp8_overflow``), not saved
    in the state dict; calibrating again resets them.

    Args:
        model (torch.nn.Module): a model with layers enabled with ``recipe="static"``.

    Returns:
        dict[str, dict[str, dict[str, float]]]: ``{layer name: {tensor: {"casts", "elements", "peak"}}}``.

    Raises:
        ValueError: ``model`` has no layer trained with recipe ``"static"``.

    Example:
        ```python
        import torchqkit as qk
        for name, tensors in qk.float8_training_overflows(model).items():
            if tensors["grad_output"]["casts"]:
                print(name, "gradients saturated", tensors["grad_output"])
        ```
    """
    layers = static_layers(model)
    if not layers:
        raise ValueError("float8_training_overflows: the model has no layer trained with recipe='static' (only static "
                         "scales can saturate and are counted)")
    out = {}
    for fqn, m in layers:
        rows = m.fp8_overflow.detach().cpu().tolist()
        out[fqn] = {t: {"casts": rows[i][0], "elements": rows[i][1], "peak": rows[i][2]}
                    for i, t in zip((X, W, GRAD), TENSORS)}
    return out
