"""float8 configs: Float8WeightOnlyConfig, Float8DynamicActivationFloat8WeightConfig,
Float8StaticActivationFloat8WeightConfig. Scales are float32 (what torch._scaled_mm takes)."""
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


def _check_float8(who: str, config, *names: str) -> None:
    for n in names:
        q = as_qdtype(getattr(config, n))
        if q.kind is not QKind.FLOAT8:
            raise ValueError(f"{who}: {n} must be float8_e4m3fn or float8_e5m2, got {q.name}")
        object.__setattr__(config, n, q)
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
    """float8 weights (per-row, per-tensor or per-block scales); activations stay in their dtype."""
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
    """float8 activations (scales computed at run time, per tensor or per row) x float8 weights.
    With PerBlock weight scales the activations are scaled per token (per row)."""
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
    """float8 activations with one static per-tensor scale x float8 weights. act_scale None: calibrated
    by ``observer`` ("minmax" or "percentile" of |x|; torchqkit/api/configs/static_activation.py)."""
    act_scale: float | None = field(default=None, metadata={"gt": 0.0})  # checked (finite, > 0) by QuantConfig
    observer: Observer = "minmax"
    percentile: float = field(default=99.99, metadata={"gt": 0.0, "le": 100.0})
    granularity: Granularity = PerTensor()

    def needs_calibration_data(self) -> bool:
        return self.act_scale is None

    def describe(self):
        scale = f"scale {self.act_scale:g}" if self.act_scale is not None else f"calibrated {self.observer}"
        return f"{self.activation_dtype.name} static act ({scale}) x {self.weight_dtype.name} weight"
