"""float8 configs: Float8WeightOnlyConfig, Float8DynamicActivationFloat8WeightConfig,
Float8StaticActivationFloat8WeightConfig. Scales are float32 (what torch._scaled_mm takes). Every float8 qdtype is
accepted: OCP float8_e4m3fn / float8_e5m2 and AMD's float8_e4m3fnuz / float8_e5m2fnuz (Note [float8 fnuz] in
core/qdtype.py); activations and weights of one config are of the same family (no float8 matmul multiplies an OCP
operand by an fnuz one)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...core.granularity import Granularity, PerBlock, PerRow, PerTensor
from ...core.qdtype import QDType, QKind, float8_e4m3fn
from ...layouts.base import Layout
from ...layouts.float8 import Float8Layout
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import UnsupportedWeight, WeightRecipe
from .base import QuantConfig, as_qdtype, register_recipe_config
from .static_activation import Observer

__all__ = ["Float8WeightOnlyConfig", "Float8DynamicActivationFloat8WeightConfig",
           "Float8StaticActivationFloat8WeightConfig"]


FLOAT8_NAMES = "float8_e4m3fn, float8_e5m2, float8_e4m3fnuz or float8_e5m2fnuz"


def _check_float8(who: str, config, *names: str) -> None:
    for n in names:
        q = as_qdtype(getattr(config, n))
        if q.kind is not QKind.FLOAT8:
            raise ValueError(f"{who}: {n} must be {FLOAT8_NAMES}, got {q.name}")
        object.__setattr__(config, n, q)
    families = {getattr(config, n).is_fnuz for n in names}
    if len(families) > 1:
        got = ", ".join(f"{n}={getattr(config, n).name}" for n in names)
        raise ValueError(f"{who}: {got} mixes an OCP float8 (e4m3fn / e5m2) with an AMD fnuz one; no float8 matmul "
                         f"takes both. Use fnuz for both (AMD MI300 GPUs) or OCP for both (everything else)")
    if not isinstance(config.granularity, (PerTensor, PerRow, PerBlock)):
        raise ValueError(f"{who}: granularity must be PerTensor(), PerRow() or PerBlock((bn, bk)) (e.g. 128x128), "
                         f"got {config.granularity!r}")


def _float8_weight(config, act=None):
    return WeightRecipe(config.weight_dtype, config.granularity, config.layout, scale_dtype=torch.float32,
                        act_quant=act, kernel_preference=config.kernel_preference)


def _float8_weight_only_recipe(config):
    return _float8_weight(config)


@register_recipe_config(_float8_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class Float8WeightOnlyConfig(QuantConfig):
    """float8 weight-only quantization; activations stay in their dtype.

    Weights are stored as float8 codes with float32 scales, per row (default), per tensor or per block (e.g.
    128x128), in ``Float8Layout``, whose linear runs ``torchqkit::linear_fp8wo`` on the stored bytes; activations
    are not quantized.

    Args:
        weight_dtype (QDType): ``float8_e4m3fn`` (default), ``float8_e5m2``, or AMD's ``float8_e4m3fnuz`` /
            ``float8_e5m2fnuz`` (max 240 / 57344, Note [float8 fnuz]), or its name.
        granularity (Granularity): ``PerRow()`` (default), ``PerTensor()`` or ``PerBlock((bn, bk))``.
        layout (Layout): how the codes are stored; default ``Float8Layout()``; a layout name is accepted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: a ``weight_dtype`` that is not float8, or another granularity.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Float8WeightOnlyConfig(granularity=qk.PerBlock((128, 128))))
        qk.quantize_(other_model, qk.Float8WeightOnlyConfig(weight_dtype="float8_e4m3fnuz"))   # AMD MI300
        ```
    """
    weight_dtype: QDType = float8_e4m3fn
    granularity: Granularity = PerRow()
    layout: Layout = field(default_factory=Float8Layout)

    def __post_init__(self):
        super().__post_init__()
        _check_float8("Float8WeightOnlyConfig", self, "weight_dtype")

    def describe(self):
        return f"{self.weight_dtype.name} weight-only {type(self.granularity).__name__}"


def _float8_dynamic_recipe(config):
    # Per-block weights (e.g. 128x128) get per-token activation scales: ActivationQuantSpec has no groups along K.
    act_granularity = PerRow() if isinstance(config.granularity, PerBlock) else config.granularity
    return _float8_weight(config, ActivationQuantSpec(config.activation_dtype, act_granularity))


@dataclass(frozen=True, kw_only=True)
class _Float8ActivationFloat8Weight(QuantConfig):
    """The fields and checks both float8 x float8 configs share; each adds its activation scale and granularity."""
    activation_dtype: QDType = float8_e4m3fn
    weight_dtype: QDType = float8_e4m3fn
    layout: Layout = field(default_factory=Float8Layout)

    def __post_init__(self):
        super().__post_init__()
        _check_float8(type(self).__name__, self, "activation_dtype", "weight_dtype")


@register_recipe_config(_float8_dynamic_recipe)
@dataclass(frozen=True, kw_only=True)
class Float8DynamicActivationFloat8WeightConfig(_Float8ActivationFloat8Weight):
    """float8 activations with scales computed at run time x float8 weights.

    Each Linear's weight is quantized to float8 with float32 scales, and its input is quantized to float8 inside
    the linear on every call (per tensor or per row). With per-tensor or per-row scales the matmul is
    ``torch._scaled_mm`` on the float8 operands; with ``PerBlock`` weight scales the activations are scaled per
    token (per row) and the reference (dequantize, then ``F.linear``) runs.

    Args:
        granularity (Granularity): the weight's (and activation's) scale granularity: ``PerRow()`` (default),
            ``PerTensor()`` or ``PerBlock((bn, bk))`` (weights only; activations then per row).
        activation_dtype (QDType): ``float8_e4m3fn`` (default), ``float8_e5m2``, ``float8_e4m3fnuz`` or
            ``float8_e5m2fnuz``, or its name.
        weight_dtype (QDType): the same choices, of the same family (both OCP or both fnuz); default
            ``float8_e4m3fn``.
        layout (Layout): how the weight codes are stored; default ``Float8Layout()``; a layout name is accepted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: a dtype that is not float8, an OCP dtype with an fnuz one, or another granularity.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Float8DynamicActivationFloat8WeightConfig(granularity=qk.PerRow()))
        ```
    """
    granularity: Granularity = PerRow()

    def describe(self):
        return f"{self.activation_dtype.name} dynamic act x {self.weight_dtype.name} weight {type(self.granularity).__name__}"


def _float8_static_recipe(config):
    if config.act_scale is None:  # never a silent dynamic scale
        raise UnsupportedWeight("Float8StaticActivationFloat8WeightConfig(act_scale=None) takes its activation scale "
                                "from calibration data, and this Linear was not calibrated; pass act_scale=..., or "
                                "calibration_data=... to quantize_ with the Linear inside the model's decoder blocks")
    act = ActivationQuantSpec(config.activation_dtype, PerTensor(), static_scale=config.act_scale)
    return _float8_weight(config, act)


@register_recipe_config(_float8_static_recipe)
@dataclass(frozen=True, kw_only=True)
class Float8StaticActivationFloat8WeightConfig(_Float8ActivationFloat8Weight):
    """float8 activations with one static per-tensor scale x float8 weights.

    The activation scale is fixed: given as ``act_scale``, or, left None, calibrated from data passed to
    ``quantize_(..., calibration_data=...)`` by ``observer``. A Linear that needs calibration but was not
    calibrated stays in float, and the report says why.

    Args:
        act_scale (float | None): the activation's per-tensor scale, a finite number > 0; None (default): calibrated.
        observer (str): how a calibrated scale is chosen: ``"minmax"`` (default; max|x|), ``"percentile"`` (the
            ``percentile``-th percentile of |x|) or ``"mse"`` (the range minimising the Linear's output error).
        percentile (float): the percentile for ``observer="percentile"``, in (0, 100]; default 99.99.
        granularity (Granularity): the weight's scale granularity: ``PerTensor()`` (default), ``PerRow()`` or
            ``PerBlock((bn, bk))``.
        activation_dtype (QDType): ``float8_e4m3fn`` (default), ``float8_e5m2``, ``float8_e4m3fnuz`` or
            ``float8_e5m2fnuz``, or its name.
        weight_dtype (QDType): the same choices, of the same family (both OCP or both fnuz); default
            ``float8_e4m3fn``.
        layout (Layout): how the weight codes are stored; default ``Float8Layout()``; a layout name is accepted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: ``act_scale`` <= 0 or not finite, ``percentile`` out of range, an unknown observer, a dtype
            that is not float8, an OCP dtype with an fnuz one, or another granularity.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Float8StaticActivationFloat8WeightConfig(act_scale=0.05))
        config = qk.Float8StaticActivationFloat8WeightConfig(observer="percentile", percentile=99.9)
        qk.quantize_(model, config, calibration_data=batches)
        ```
    """
    act_scale: float | None = field(default=None, metadata={"gt": 0.0})  # checked (finite, > 0) by QuantConfig
    observer: Observer = "minmax"
    percentile: float = field(default=99.99, metadata={"gt": 0.0, "le": 100.0})
    granularity: Granularity = PerTensor()

    def needs_calibration_data(self) -> bool:
        return self.act_scale is None

    def describe(self):
        scale = f"scale {self.act_scale:g}" if self.act_scale is not None else f"calibrated {self.observer}"
        return f"{self.activation_dtype.name} static act ({scale}) x {self.weight_dtype.name} weight"
