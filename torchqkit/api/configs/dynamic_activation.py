"""Dynamic int8 activation configs: Int8DynamicActivationInt8WeightConfig, Int8DynamicActivationIntxWeightConfig.

The activation is quantized per token inside the linear, from an ActivationQuantSpec stored on the weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.granularity import Granularity, PerGroup, PerRow, PerToken
from ...core.primitives import MappingType
from ...core.qdtype import INT, int8
from ...layouts.base import Layout
from ...layouts.packed_intx import PackedIntxLayout
from ...layouts.plain import PlainLayout
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, register_recipe_config
from .integer import _granularity_text, check_intx

__all__ = ["Int8DynamicActivationInt8WeightConfig", "Int8DynamicActivationIntxWeightConfig"]


def _int8_dynamic_activation_int8_weight_recipe(config):
    act = ActivationQuantSpec(int8, PerToken(), config.act_mapping)
    return WeightRecipe(int8, PerRow(), config.layout, mapping=MappingType.SYMMETRIC, act_quant=act,
                        kernel_preference=config.kernel_preference)


@register_recipe_config(_int8_dynamic_activation_int8_weight_recipe)
@dataclass(frozen=True, kw_only=True)
class Int8DynamicActivationInt8WeightConfig(QuantConfig):
    """int8 per-token activations (quantized at run time) x int8 per-channel symmetric weights."""
    act_mapping: MappingType = MappingType.SYMMETRIC
    layout: Layout = field(default_factory=PlainLayout)

    def describe(self):
        return f"int8 dynamic act ({self.act_mapping.value}) x int8 weight"


def _int8_dynamic_activation_intx_weight_recipe(config):
    act = ActivationQuantSpec(int8, PerToken(), config.act_mapping)
    return WeightRecipe(INT[config.weight_bits], config.weight_granularity, config.resolved_layout(),
                        mapping=config.weight_mapping, act_quant=act, kernel_preference=config.kernel_preference)


@register_recipe_config(_int8_dynamic_activation_intx_weight_recipe)
@dataclass(frozen=True, kw_only=True)
class Int8DynamicActivationIntxWeightConfig(QuantConfig):
    """int8 per-token activations x 1..8-bit weights (per group or per channel).

    layout=None (default): PackedIntxLayout for 4-bit weights (two codes per byte, served by the VNNI kernel
    torchqkit::linear_int8da_int4_packed), PlainLayout otherwise."""
    weight_bits: int = 4
    weight_granularity: Granularity = PerGroup(32)
    weight_mapping: MappingType = MappingType.SYMMETRIC
    act_mapping: MappingType = MappingType.ASYMMETRIC
    layout: Layout | None = None

    def __post_init__(self):
        super().__post_init__()  # also turns mapping names into MappingType (QuantConfig's field checks)
        check_intx("Int8DynamicActivationIntxWeightConfig", self.weight_bits, self.weight_granularity,
                   self.weight_mapping)

    def resolved_layout(self) -> Layout:
        """The layout the weights get: ``layout``, or by default packed nibbles at 4 bits, plain otherwise."""
        if self.layout is not None:
            return self.layout
        return PackedIntxLayout() if self.weight_bits == 4 else PlainLayout()

    def describe(self):
        return (f"int8 dynamic act x int{self.weight_bits} weight "
                f"{_granularity_text(self.weight_granularity)} {self.weight_mapping.value}")
