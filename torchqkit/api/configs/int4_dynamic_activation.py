"""int4 weights with 4-bit or float8 dynamic activations: Int4DynamicActivationInt4WeightConfig (W4A4),
Float8DynamicActivationInt4WeightConfig (W4A8 with float8 activations).

Weights: symmetric int4 codes per group of input features (or per output channel) in PackedIntxLayout. The
Linear's input is quantized on every call from the ActivationQuantSpec stored on the weight. On CPU, int4 activation
codes are summed against the int4 weights by ``torchqkit::linear_int8da_int4_packed`` (the W4A8 kernel, with int4
codes); float8 activations, which no CPU instruction multiplies, are quantized and dequantized (fake-quantized) and
the weight-only kernel ``torchqkit::linear_intxwo`` multiplies them with the stored codes, as it does for int4
activations on a GPU (Note [Activations fake-quantized before a weight-only kernel] in layouts/routes.py);
``torchqkit.kernels.status()`` lists the routes. 4-bit activations need
``rotate_`` first on an LLM: without it a few outlier features set each token's scale and flatten the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.granularity import PerGroup, PerRow, PerToken
from ...core.primitives import MappingType
from ...core.qdtype import QDType, QKind, float8_e4m3fn, int4
from ...layouts.base import Layout
from ...layouts.packed_intx import PackedIntxLayout
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, as_qdtype, register_recipe_config

__all__ = ["Int4DynamicActivationInt4WeightConfig", "Float8DynamicActivationInt4WeightConfig"]


def _int4_weight(config, act: ActivationQuantSpec) -> WeightRecipe:
    granularity = PerRow() if config.group_size is None else PerGroup(config.group_size)
    return WeightRecipe(int4, granularity, config.layout, mapping=MappingType.SYMMETRIC, act_quant=act,
                        kernel_preference=config.kernel_preference)


def _group_text(group_size: int | None) -> str:
    return "per channel" if group_size is None else f"g{group_size}"


def _int4_dynamic_activation_int4_weight_recipe(config):
    act_granularity = PerToken() if config.act_group_size is None else PerGroup(config.act_group_size)
    return _int4_weight(config, ActivationQuantSpec(int4, act_granularity, config.act_mapping))


@register_recipe_config(_int4_dynamic_activation_int4_weight_recipe)
@dataclass(frozen=True, kw_only=True)
class Int4DynamicActivationInt4WeightConfig(QuantConfig):
    """int4 activations quantized at run time x symmetric int4 weights (W4A4).

    Each Linear's weight becomes symmetric int4 codes with one scale per ``group_size`` input features (or per
    output channel), two codes per byte (``PackedIntxLayout``); its input is quantized to int4 per token (or per
    token and group of ``act_group_size`` features) on every call. On an LLM, call ``rotate_`` first (QuaRot):
    4-bit activations lose too much to outlier features otherwise. On CPU the int4 codes are multiplied by
    ``torchqkit::linear_int8da_int4_packed`` (integer sums; activation groups other than the weight's run the
    weight-only kernel on the fake-quantized input); on a GPU ``torchqkit::linear_intxwo`` on the fake-quantized input
    (``torchqkit.kernels.status()`` lists them).

    Args:
        group_size (int | None): weight input features per scale; None: one scale per output channel. Default 32.
        act_group_size (int | None): activation features per scale within a token (symmetric); None (default): one
            scale per token.
        act_mapping (MappingType): ``MappingType.SYMMETRIC`` (default) or ``ASYMMETRIC`` (a zero point per token;
            per token only), or their values.
        layout (Layout): how the weight codes are stored; default ``PackedIntxLayout()``; a layout name is accepted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: a group size below 1, or ``act_group_size`` with an asymmetric ``act_mapping``.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.rotate_(model)
        qk.quantize_(model, qk.Int4DynamicActivationInt4WeightConfig(group_size=128))
        ```
    """
    group_size: int | None = 32
    act_group_size: int | None = None
    act_mapping: MappingType = MappingType.SYMMETRIC
    layout: Layout = field(default_factory=PackedIntxLayout)

    def __post_init__(self):
        super().__post_init__()
        if self.act_group_size is not None and self.act_mapping is not MappingType.SYMMETRIC:
            raise ValueError("Int4DynamicActivationInt4WeightConfig: activations per group (act_group_size) are "
                             "quantized symmetrically; pass act_mapping='symmetric'")

    def describe(self):
        act = "per token" if self.act_group_size is None else f"per {self.act_group_size}"
        return f"int4 dynamic act ({act}, {self.act_mapping.value}) x int4 weight {_group_text(self.group_size)}"


def _float8_dynamic_activation_int4_weight_recipe(config):
    return _int4_weight(config, ActivationQuantSpec(config.act_dtype, PerRow()))


@register_recipe_config(_float8_dynamic_activation_int4_weight_recipe)
@dataclass(frozen=True, kw_only=True)
class Float8DynamicActivationInt4WeightConfig(QuantConfig):
    """float8 activations quantized at run time (one scale per token) x symmetric int4 weights.

    Weights as ``Int4DynamicActivationInt4WeightConfig``; each Linear's input is quantized to float8 with one
    float32 scale per token on every call. The product runs the weight-only kernel ``torchqkit::linear_intxwo`` on
    the fake-quantized input (``torchqkit.kernels.status()`` lists it).

    Args:
        group_size (int | None): weight input features per scale; None: one scale per output channel. Default 32.
        act_dtype (QDType): ``float8_e4m3fn`` (default), ``float8_e5m2``, ``float8_e4m3fnuz`` or ``float8_e5m2fnuz``,
            or its name.
        layout (Layout): how the weight codes are stored; default ``PackedIntxLayout()``; a layout name is accepted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: an ``act_dtype`` that is not float8, or a group size below 1.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Float8DynamicActivationInt4WeightConfig(group_size=128))
        ```
    """
    group_size: int | None = 32
    act_dtype: QDType = float8_e4m3fn
    layout: Layout = field(default_factory=PackedIntxLayout)

    def __post_init__(self):
        super().__post_init__()
        q = as_qdtype(self.act_dtype)
        if q.kind is not QKind.FLOAT8:
            raise ValueError(f"Float8DynamicActivationInt4WeightConfig: act_dtype must be float8_e4m3fn, float8_e5m2, "
                             f"float8_e4m3fnuz or float8_e5m2fnuz, got {q.name}")
        object.__setattr__(self, "act_dtype", q)

    def describe(self):
        return f"{self.act_dtype.name} dynamic act (per token) x int4 weight {_group_text(self.group_size)}"
