"""NF4WeightOnlyConfig: QLoRA's 4-bit NormalFloat weights (NF4Layout), optionally double-quantized."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.granularity import PerGroup
from ...core.qdtype import nf4
from ...layouts.nf4 import NF4Layout
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, register_recipe_config

__all__ = ["NF4WeightOnlyConfig"]


def _nf4_weight_only_recipe(config):
    # float32 absmax, as bitsandbytes stores it: a bf16 absmax would round the block's largest weight.
    return WeightRecipe(nf4, PerGroup(config.block_size),
                        NF4Layout(block_size=config.block_size, double_quant=config.double_quant),
                        scale_dtype=torch.float32, kernel_preference=config.kernel_preference)


@register_recipe_config(_nf4_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class NF4WeightOnlyConfig(QuantConfig):
    """NF4 codes with one absmax per ``block_size`` weights of a row; ``double_quant`` stores the absmax
    values in 8 bits (QLoRA). The weight stays trainable-through: gradients reach inputs and adapters."""
    block_size: int = 64
    double_quant: bool = False

    def __post_init__(self):
        super().__post_init__()
        NF4Layout(block_size=self.block_size)  # validates block_size with NF4Layout's message

    def describe(self):
        return f"nf4 weight-only b{self.block_size}" + (" double-quant" if self.double_quant else "")
