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
    """int8 activations quantized at run time (per token) x int8 per-channel symmetric weights (W8A8).

    Each Linear's weight becomes int8 codes with one symmetric scale per output channel; its input is quantized
    to int8 per token inside the linear on every call, so the matmul runs on integers. Use it where int8 matmuls
    are fast; wrap it in ``SmoothQuantConfig`` when activations have outlier channels.

    Args:
        act_mapping (MappingType): how activations are quantized: ``MappingType.SYMMETRIC`` (default) or
            ``ASYMMETRIC`` (a zero point per token), or their values (``"symmetric"``, ``"asymmetric"``).
        layout (Layout): how the weight codes are stored; default ``PlainLayout()``; a layout name is accepted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: an unknown mapping or layout name.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Int8DynamicActivationInt8WeightConfig(act_mapping="asymmetric"))
        ```
    """
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
    """int8 dynamic activations x 1- to 8-bit integer weights, per group or per output channel.

    The weight is quantized to ``weight_bits``-bit codes; the Linear's input is quantized to int8 at run time,
    per token or per token and group of features, and the product is computed on integers where a kernel exists
    (4-bit weights in ``PackedIntxLayout`` are served by the VNNI kernel ``torchqkit::linear_int8da_int4_packed``
    on CPU). With asymmetric weights and ``weight_zero_point_domain="float"`` it stores GGUF Q4_1's format
    (float16 scale and float minimum per 32 weights), and ``act_granularity=PerGroup(32)`` quantizes activations
    as llama.cpp's Q8_1 does, which keeps an LLM's outlier features from flattening the rest of the token.

    Args:
        weight_bits (int): weight code width, 1..8. Default 4.
        weight_granularity (Granularity): ``PerGroup(n)`` (default ``PerGroup(32)``), ``PerAxis(0)`` or ``PerRow()``.
        weight_mapping (MappingType): ``MappingType.SYMMETRIC`` (default), ``ASYMMETRIC`` or
            ``SYMMETRIC_NO_CLIPPING_ERR``, or their values.
        act_mapping (MappingType): ``MappingType.ASYMMETRIC`` (default) or ``SYMMETRIC``; must be symmetric when
            ``act_granularity`` is a ``PerGroup``.
        act_granularity (Granularity): ``PerToken()`` (default; one scale per token) or ``PerGroup(n)`` equal to
            ``weight_granularity`` (one symmetric scale per token and group of n features).
        weight_zero_point_domain (ZeroPointDomain | None): None (default; integer zero points when asymmetric),
            ``"int"`` or ``"float"`` (a float zero point per group, w = q * s + z: GGUF's Q4_1, whose minimum an
            integer zero point can't hold) for an asymmetric ``weight_mapping``, ``"none"`` for a symmetric one.
        weight_scale_dtype (str | None): dtype of the stored scales and zero points: None (default; the weight's
            dtype), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        layout (Layout | None): how the weight codes are stored; None (default): ``PackedIntxLayout()`` for 4-bit
            weights (two codes per byte), ``PlainLayout()`` otherwise (see ``resolved_layout()``).
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: ``weight_bits`` outside 1..8, an unsupported granularity, a ``PerGroup`` activation granularity
            that differs from the weight's or is not symmetric, or a zero-point domain that doesn't match
            ``weight_mapping``.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Int8DynamicActivationIntxWeightConfig(weight_bits=4, weight_granularity=qk.PerGroup(32)))
        q41 = qk.Int8DynamicActivationIntxWeightConfig(
            weight_mapping="asymmetric", weight_zero_point_domain="float", weight_scale_dtype="float16",
            act_granularity=qk.PerGroup(32), act_mapping="symmetric")
        ```
    """
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
