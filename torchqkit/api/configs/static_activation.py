"""Static activation scales: Int8StaticActivationInt8WeightConfig, and the observer fields it shares with
Float8StaticActivationFloat8WeightConfig.

A static config takes its per-tensor activation scale as ``act_scale``, or, left None, from calibration data
(``quantize_(..., calibration_data=batches)``): the observer sees every input of the Linear and sets
scale = range / qmax, the range being max|x| ("minmax") or the ``percentile``-th percentile of |x|.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...core.granularity import PerRow, PerTensor
from ...core.primitives import MappingType
from ...core.qdtype import int8
from ...layouts.base import Layout
from ...layouts.plain import PlainLayout
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import UnsupportedWeight, quantize_weight
from .base import QuantConfig, register_config

__all__ = ["Int8StaticActivationInt8WeightConfig", "Observer", "needs_static_scale"]

Observer = Literal["minmax", "percentile", "mse"]


def needs_static_scale(config, weight, name) -> None:
    if config.act_scale is None:
        raise UnsupportedWeight(f"{name}: {type(config).__name__}(act_scale=None) takes its activation scale from "
                                f"calibration data, and {name} was not calibrated; pass act_scale=..., or "
                                f"calibration_data=... to quantize_ with the Linear inside the model's decoder blocks")


def _int8_static_transform(config, weight, name):
    needs_static_scale(config, weight, name)
    act = ActivationQuantSpec(int8, PerTensor(), MappingType.SYMMETRIC, static_scale=config.act_scale)
    return quantize_weight(weight, int8, PerRow(), config.layout, mapping=MappingType.SYMMETRIC, act_quant=act,
                           kernel_preference=config.kernel_preference, name=name)


@register_config(_int8_static_transform)
@dataclass(frozen=True, kw_only=True)
class Int8StaticActivationInt8WeightConfig(QuantConfig):
    """int8 activations with one static per-tensor scale (symmetric) x int8 per-channel symmetric weights.
    act_scale None: calibrated by ``observer`` ("minmax" or "percentile" of |x|, see the module docstring)."""
    act_scale: float | None = field(default=None, metadata={"gt": 0.0})
    observer: Observer = "minmax"
    percentile: float = field(default=99.99, metadata={"gt": 0.0, "le": 100.0})
    layout: Layout = field(default_factory=PlainLayout)

    def needs_calibration_data(self) -> bool:
        return self.act_scale is None

    def describe(self):
        scale = f"scale {self.act_scale:g}" if self.act_scale is not None else f"calibrated {self.observer}"
        return f"int8 static act ({scale}) x int8 weight"
