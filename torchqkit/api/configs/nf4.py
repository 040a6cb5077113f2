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
    """NF4 weight-only quantization: QLoRA's 4-bit NormalFloat codes, optionally double-quantized.

    Each block of ``block_size`` weights of a row gets one float32 absmax scale, and the weights become NF4 codes
    (stored in ``NF4Layout``). With ``double_quant`` the absmax values are themselves stored in 8 bits, as QLoRA
    does. Gradients flow through the quantized weight to the inputs and to adapters, so it is the base for QLoRA
    fine-tuning (``add_lora_``).

    Args:
        block_size (int): weights per absmax scale along a row: an even int >= 2 (codes pack two per
            byte); default 64.
        double_quant (bool): store the absmax values in 8 bits; default False.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: ``block_size`` not a positive even int.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.NF4WeightOnlyConfig(block_size=64, double_quant=True))
        ```
    """
    block_size: int = 64
    double_quant: bool = False

    def __post_init__(self):
        super().__post_init__()
        NF4Layout(block_size=self.block_size)  # validates block_size with NF4Layout's message

    def describe(self):
        return f"nf4 weight-only b{self.block_size}" + (" double-quant" if self.double_quant else "")
