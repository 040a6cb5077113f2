"""Dynamic int8 activation configs: Int8DynamicActivationInt8WeightConfig, Int8DynamicActivationIntxWeightConfig.

The activation is quantized inside the linear (per token, or per token and weight group), from an
ActivationQuantSpec stored on the weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...core.granularity import Granularity, PerGroup, PerRow, PerToken
from ...core.primitives import MappingType, ZeroPointDomain
from ...core.qdtype import INT, int8
from ...layouts.base import Layout
from ...layouts.packed_intx import PackedIntxLayout
from ...layouts.plain import PlainLayout
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, register_recipe_config
from .integer import INT4_SCALE_DTYPES, _granularity_text, check_intx

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
    act = ActivationQuantSpec(int8, config.act_granularity, config.act_mapping)
    return WeightRecipe(INT[config.weight_bits], config.weight_granularity, config.resolved_layout(),
                        mapping=config.weight_mapping, zero_point_domain=config.weight_zero_point_domain,
                        scale_dtype=INT4_SCALE_DTYPES.get(config.weight_scale_dtype), act_quant=act,
                        kernel_preference=config.kernel_preference)


@register_recipe_config(_int8_dynamic_activation_intx_weight_recipe)
@dataclass(frozen=True, kw_only=True)
class Int8DynamicActivationIntxWeightConfig(QuantConfig):
    """int8 dynamic activations x 1..8-bit weights (per group or per channel).

    layout=None (default): PackedIntxLayout for 4-bit weights (two codes per byte, served by the VNNI kernel
    torchqkit::linear_int8da_int4_packed), PlainLayout otherwise.
    act_granularity: PerToken() (one scale per token) or PerGroup(n) with n the weight's group size: one symmetric
    scale per token and group of n features, as llama.cpp quantizes activations (Q8_1 blocks of 32) for its
    integer dot products; it keeps an LLM's outlier features from flattening the rest of the token.
    weight_zero_point_domain: None (integer zero points when asymmetric), "int", or "float": w = q s + z with a
    float z per group, GGUF's Q4_1 (an integer zero point can't hold Q4_1's minimum: requantized, its grid moves).
    weight_scale_dtype: dtype of the stored scales and zero points, as Int4WeightOnlyConfig's scale_dtype."""
    weight_bits: int = 4
    weight_granularity: Granularity = PerGroup(32)
    weight_mapping: MappingType = MappingType.SYMMETRIC
    act_mapping: MappingType = MappingType.ASYMMETRIC
    act_granularity: Granularity = PerToken()
    weight_zero_point_domain: ZeroPointDomain | None = None
    weight_scale_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    layout: Layout | None = None

    def __post_init__(self):
        super().__post_init__()  # also turns mapping names into MappingType (QuantConfig's field checks)
        who = "Int8DynamicActivationIntxWeightConfig"
        check_intx(who, self.weight_bits, self.weight_granularity, self.weight_mapping)
        g = self.act_granularity
        if isinstance(g, PerGroup):
            if self.weight_granularity != g:
                raise ValueError(f"{who}: act_granularity {g!r} must match weight_granularity "
                                 f"{self.weight_granularity!r}: each weight group's dot product is scaled by its "
                                 f"activation group's scale")
            if self.act_mapping is not MappingType.SYMMETRIC:
                raise ValueError(f"{who}: act_granularity PerGroup quantizes activations symmetrically; pass "
                                 f"act_mapping='symmetric'")
        elif not isinstance(g, PerToken):
            raise ValueError(f"{who}: act_granularity must be PerToken() or PerGroup(n), got {g!r}")
        zpd = self.weight_zero_point_domain
        if zpd is not None and (zpd is ZeroPointDomain.NONE) != (self.weight_mapping is not MappingType.ASYMMETRIC):
            raise ValueError(f"{who}: weight_zero_point_domain={zpd.value!r} doesn't go with weight_mapping="
                             f"{self.weight_mapping.value!r}: zero points ('int' / 'float') are for 'asymmetric', "
                             f"'none' for 'symmetric'")

    def resolved_layout(self) -> Layout:
        """The layout the weights get: ``layout``, or by default packed nibbles at 4 bits, plain otherwise."""
        if self.layout is not None:
            return self.layout
        return PackedIntxLayout() if self.weight_bits == 4 else PlainLayout()

    def describe(self):
        act = " per group" if isinstance(self.act_granularity, PerGroup) else ""
        zero = " float zero" if self.weight_zero_point_domain is ZeroPointDomain.FLOAT else ""
        scales = f", {self.weight_scale_dtype} scales" if self.weight_scale_dtype else ""
        return (f"int8 dynamic act{act} x int{self.weight_bits} weight "
                f"{_granularity_text(self.weight_granularity)} {self.weight_mapping.value}{zero}{scales}")
