"""OCP microscaling configs: MXFP8WeightOnlyConfig, MXFP4WeightOnlyConfig (MXLayout), and
MXDynamicActivationMXWeightConfig (MX weights x MXFP8 activations).

One power-of-two (E8M0) scale per 32 weights along K, chosen as the MX spec says (the oracle's
``scale_rounding="power_of_two"``); weights whose in_features isn't a multiple of 32 get a partial last block (padded inside MXLayout).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from ...core.granularity import PerGroup
from ...core.qdtype import QDType, float8_e4m3fn, float8_e5m2, fp4_e2m1
from ...layouts.mx import MX_BLOCK, MXLayout
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, as_qdtype, register_recipe_config

__all__ = ["MXFP8WeightOnlyConfig", "MXFP4WeightOnlyConfig", "MXDynamicActivationMXWeightConfig"]


def _mx_weight(element: QDType, config):
    return WeightRecipe(element, PerGroup(MX_BLOCK), MXLayout(), scale_dtype=torch.float32,
                        scale_rounding="power_of_two", kernel_preference=config.kernel_preference)


def _mxfp8_weight_only_recipe(config):
    return _mx_weight(config.element_dtype, config)


@register_recipe_config(_mxfp8_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class MXFP8WeightOnlyConfig(QuantConfig):
    """MXFP8 weight-only quantization: float8 elements with one E8M0 (power-of-two) scale per 32 weights along K.

    The OCP microscaling format: each block of 32 input features of a row shares a power-of-two scale chosen as
    the MX spec says, and the elements are float8 (``MXLayout``). A weight whose in_features isn't a multiple of
    32 gets a partial last block. Activations stay in float.

    Args:
        element_dtype (QDType): the element format: ``float8_e4m3fn`` (default) or ``float8_e5m2``, or its name.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: an ``element_dtype`` other than the two float8 formats (or an unknown name).

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.MXFP8WeightOnlyConfig(element_dtype="float8_e5m2"))
        ```
    """
    element_dtype: QDType = float8_e4m3fn

    def __post_init__(self):
        super().__post_init__()
        q = as_qdtype(self.element_dtype)
        if q not in (float8_e4m3fn, float8_e5m2):
            fnuz = (f" (the OCP MX spec's elements are OCP float8; for AMD's fnuz formats use "
                    f"Float8WeightOnlyConfig(weight_dtype={q.name!r}, granularity=PerBlock((1, 32))))" if q.is_fnuz
                    else "")
            raise ValueError(f"MXFP8WeightOnlyConfig: element_dtype must be float8_e4m3fn or float8_e5m2, got "
                             f"{q.name}{fnuz}")
        object.__setattr__(self, "element_dtype", q)

    def describe(self):
        return f"mxfp8 ({self.element_dtype.name}) weight-only"


def _mxfp4_weight_only_recipe(config):
    return _mx_weight(fp4_e2m1, config)


@register_recipe_config(_mxfp4_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class MXFP4WeightOnlyConfig(QuantConfig):
    """MXFP4 weight-only quantization: fp4 (e2m1) elements, two per byte, with one E8M0 scale per 32 weights along K.

    The OCP microscaling format with 4-bit float elements (``MXLayout``); each block of 32 input features of a
    row shares a power-of-two scale. A weight whose in_features isn't a multiple of 32 gets a partial last
    block. Activations stay in float.

    Args:
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_(model, qk.MXFP4WeightOnlyConfig())
        ```
    """

    def describe(self):
        return "mxfp4 (fp4_e2m1) weight-only"


_MX_WEIGHTS = {"mxfp4": fp4_e2m1, "mxfp8": float8_e4m3fn}


def _mx_dynamic_activation_recipe(config):
    recipe = _mx_weight(_MX_WEIGHTS[config.weight], config)
    return dataclasses.replace(recipe, act_quant=ActivationQuantSpec(float8_e4m3fn, PerGroup(MX_BLOCK)))


@register_recipe_config(_mx_dynamic_activation_recipe)
@dataclass(frozen=True, kw_only=True)
class MXDynamicActivationMXWeightConfig(QuantConfig):
    """MX weights x MXFP8 activations quantized at run time (one E8M0 scale per token and 32 features).

    Weights as ``MXFP4WeightOnlyConfig`` (``weight="mxfp4"``) or ``MXFP8WeightOnlyConfig`` (``"mxfp8"``, e4m3
    elements). Each Linear's input is quantized on every call to float8 e4m3 with one power-of-two scale per token
    and block of 32 input features, chosen as the OCP MX spec says (the MX block runs along K for activations as
    for weights). The product runs the weight-only kernel ``torchqkit::linear_mxwo`` on the fake-quantized input
    (``torchqkit.kernels.status()`` lists it).

    Args:
        activation (str): the activation format: ``"mxfp8"`` (default; the only one).
        weight (str): the weight format: ``"mxfp4"`` (default) or ``"mxfp8"``.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: another activation or weight format.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.MXDynamicActivationMXWeightConfig(activation="mxfp8", weight="mxfp4"))
        ```
    """
    activation: Literal["mxfp8"] = "mxfp8"
    weight: Literal["mxfp4", "mxfp8"] = "mxfp4"

    def describe(self):
        return f"{self.weight} weights x {self.activation} dynamic activations (per 32)"
