"""FP6WeightOnlyConfig: FP6 (e3m2 / e2m3) weights with float scales per row or per group (FP6Layout)."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.granularity import PerGroup, PerRow
from ...kernels.ops.linear_fp6wo import fp6_qdtype
from ...layouts.fp6 import FP6Layout
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, register_recipe_config

__all__ = ["FP6WeightOnlyConfig"]


def _fp6_weight_only_recipe(config):
    granularity = PerRow() if config.group_size is None else PerGroup(config.group_size)
    return WeightRecipe(fp6_qdtype(config.ebits), granularity, FP6Layout(), kernel_preference=config.kernel_preference)


@register_recipe_config(_fp6_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class FP6WeightOnlyConfig(QuantConfig):
    """FP6 weight-only quantization: 6-bit float codes (e3m2 or e2m3), four in three bytes, with float scales.

    Each weight is the nearest FP6 value (OCP MX FP6 E3M2 or E2M3: sign, exponent, mantissa; no inf / NaN) of the
    weight over its scale, the scale being the block's absmax over the format's largest value (28 for e3m2, 7.5 for
    e2m3), one per row or per group of input features, in the weight's dtype (``FP6Layout``). e3m2 has the wider
    range, e2m3 the finer steps. Activations stay in float.

    Args:
        ebits (int): exponent bits: 3 (default, ``fp6_e3m2``) or 2 (``fp6_e2m3``).
        group_size (int | None): input features per scale; None (default): one scale per row.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: ``ebits`` other than 2 or 3, or a ``group_size`` that is not a positive int.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.FP6WeightOnlyConfig(ebits=2, group_size=32))
        ```
    """
    ebits: int = 3
    group_size: int | None = None

    def __post_init__(self):
        super().__post_init__()
        fp6_qdtype(self.ebits)  # raises for anything but 2 / 3
        if self.group_size is not None and (type(self.group_size) is not int or self.group_size < 1):
            raise ValueError(f"FP6WeightOnlyConfig: group_size must be a positive int or None, got {self.group_size!r}")

    def describe(self):
        per = "per row" if self.group_size is None else f"g{self.group_size}"
        return f"{fp6_qdtype(self.ebits).name} weight-only {per}"
