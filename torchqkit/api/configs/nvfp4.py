"""NVFP4 configs: NVFP4WeightOnlyConfig, NVFP4DynamicActivationNVFP4WeightConfig (NVFP4Layout).

e2m1 weights with one float8 e4m3 scale per 16 weights along K and one float32 scale per tensor, chosen by the
oracle's ``scale_rounding="float8_e4m3"`` (Note [Float8 block scales] in core/primitives.py); weights whose
in_features isn't a multiple of 16 get a partial last block (padded inside NVFP4Layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.granularity import PerGroup
from ...core.qdtype import fp4_e2m1
from ...layouts.nvfp4 import NVFP4Layout
from ...kernels.ops.linear_nvfp4wo import NVFP4_BLOCK
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, register_recipe_config

__all__ = ["NVFP4WeightOnlyConfig", "NVFP4DynamicActivationNVFP4WeightConfig"]


def _nvfp4_weight(config, act=None):
    return WeightRecipe(fp4_e2m1, PerGroup(NVFP4_BLOCK), NVFP4Layout(), scale_dtype=torch.float32,
                        scale_rounding="float8_e4m3", act_quant=act, kernel_preference=config.kernel_preference)


@register_recipe_config(_nvfp4_weight)
@dataclass(frozen=True, kw_only=True)
class NVFP4WeightOnlyConfig(QuantConfig):
    """NVFP4 weight-only quantization: fp4 (e2m1) weights with a float8 e4m3 scale per 16 and a float32 one per tensor.

    NVIDIA's 4-bit float format (``NVFP4Layout``, byte for byte the checkpoints of ModelOpt and compressed-tensors'
    ``nvfp4-pack-quantized``): each block of 16 input features of a row shares a float8 e4m3 scale, and one
    float32 scale per weight puts those scales into e4m3's range. 4.5 bits per weight. Finer blocks and
    non-power-of-two block scales make it more accurate than MXFP4 at about the same size. A weight whose
    in_features isn't a multiple of 16 gets a partial last block. Activations stay in float.

    Args:
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_(model, qk.NVFP4WeightOnlyConfig())
        ```
    """

    def describe(self):
        return "nvfp4 (fp4_e2m1, float8 scales per 16) weight-only"


def _nvfp4_dynamic_recipe(config):
    return _nvfp4_weight(config, ActivationQuantSpec(fp4_e2m1, PerGroup(NVFP4_BLOCK)))


@register_recipe_config(_nvfp4_dynamic_recipe)
@dataclass(frozen=True, kw_only=True)
class NVFP4DynamicActivationNVFP4WeightConfig(QuantConfig):
    """NVFP4 weights and NVFP4 activations, the activations quantized on the fly per token and 16 features.

    Weights as ``NVFP4WeightOnlyConfig``. Each linear quantizes its input to e2m1 with a float8 e4m3 scale per token
    and block of 16 features under one power-of-two scale per call (the W4A4 scheme of compressed-tensors' NVFP4
    preset). The product runs the weight-only kernel ``torchqkit::linear_nvfp4wo`` on the fake-quantized input
    (quantized and dequantized); ``torchqkit.kernels.status()`` lists it.

    Args:
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_(model, qk.NVFP4DynamicActivationNVFP4WeightConfig())
        ```
    """

    def describe(self):
        return "nvfp4 weights x nvfp4 dynamic activations (per 16)"
