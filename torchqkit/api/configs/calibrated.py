"""Calibrated configs: GPTQConfig, AWQConfig, SmoothQuantConfig wrap a weight config and choose its codes,
or scale its input channels, from calibration data (``quantize_(..., calibration_data=batches)``).

The result is the wrapped config's ordinary layout data (see torchqkit/api/calibrate.py), so its kernels,
checkpoints and torch.compile paths serve it. The wrapped config's kernel_preference is the one that
applies. Called without calibration (``quantize_checkpoint``, a Linear outside the calibrated blocks), the
handler refuses the weight and quantize_ reports why.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..quantize_weight import UnsupportedWeight
from .base import QuantConfig, register_config
from .dynamic_activation import Int8DynamicActivationInt8WeightConfig
from .float8 import Float8DynamicActivationFloat8WeightConfig, Float8StaticActivationFloat8WeightConfig
from .integer import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
from .nf4 import NF4WeightOnlyConfig
from .static_activation import Int8StaticActivationInt8WeightConfig

__all__ = ["GPTQConfig", "AWQConfig", "SmoothQuantConfig", "CalibratedConfig"]


def _needs_calibration(config, weight, name):
    raise UnsupportedWeight(f"{name}: {type(config).__name__} chooses codes from calibration data, and {name} was not "
                            f"calibrated (quantize_ calibrates the Linears inside the model's decoder blocks, given "
                            f"calibration_data=...); quantize it with {type(config.base).__name__} or keep it in float")


@dataclass(frozen=True, kw_only=True)
class CalibratedConfig(QuantConfig):
    """A weight config (``base``) whose codes or input scales come from calibration data."""
    base: QuantConfig = field(default_factory=Int4WeightOnlyConfig, kw_only=False)
    BASES = ()

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.base, self.BASES):
            raise TypeError(f"{type(self).__name__}: base must be one of {[c.__name__ for c in self.BASES]}, "
                            f"got {type(self.base).__name__}")

    def needs_calibration_data(self) -> bool:
        return True


@register_config(_needs_calibration)
@dataclass(frozen=True, kw_only=True)
class GPTQConfig(CalibratedConfig):
    """GPTQ codes for ``base``'s qparams grid: damp (fraction of the mean Hessian diagonal added to it),
    block (columns per lazy batch update), act_order (columns by decreasing Hessian diagonal; implies
    static_groups), static_groups (every group's qparams from the original weight, not the updated one), true_sequential
    (inside a decoder block, each set of Linears sharing an input is calibrated after the ones before it are
    quantized: o_proj's Hessian from quantized q/k/v, down_proj's from quantized gate/up; one block pass each)."""
    damp: float = field(default=0.01, metadata={"gt": 0.0, "le": 1.0})
    block: int = field(default=128, metadata={"ge": 1})
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = False
    BASES = (Int4WeightOnlyConfig, IntxWeightOnlyConfig, Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig)

    def describe(self):
        order = (" act-order" if self.act_order else "") + (" true-sequential" if self.true_sequential else "")
        return f"gptq{order} ({self.base.describe()})"


@register_config(_needs_calibration)
@dataclass(frozen=True, kw_only=True)
class AWQConfig(CalibratedConfig):
    """Activation-aware scaling for ``base``: per input channel scales s = mean|x|^r (r searched on n_grid
    points) multiply the weight's columns and divide the previous norm / Linear (folded); clip: also search
    per group how far to shrink the weight range (not for attention query / key projections)."""
    base: QuantConfig = field(default_factory=Int4WeightOnlyConfig, kw_only=False)
    n_grid: int = field(default=20, metadata={"ge": 2})
    clip: bool = True
    BASES = (Int4WeightOnlyConfig, IntxWeightOnlyConfig, NF4WeightOnlyConfig)

    def describe(self):
        return f"awq{' +clip' if self.clip else ''} ({self.base.describe()})"


@register_config(_needs_calibration)
@dataclass(frozen=True, kw_only=True)
class SmoothQuantConfig(CalibratedConfig):
    """SmoothQuant for ``base``: per input channel s = max|x|^alpha / max|w|^(1 - alpha) moves activation
    outliers into the weights (x / s folded into the previous norm / Linear, w * s)."""
    base: QuantConfig = field(default_factory=Int8DynamicActivationInt8WeightConfig, kw_only=False)
    alpha: float = field(default=0.5, metadata={"ge": 0.0, "le": 1.0})
    BASES = (Int8DynamicActivationInt8WeightConfig, Int8StaticActivationInt8WeightConfig,
             Float8DynamicActivationFloat8WeightConfig, Float8StaticActivationFloat8WeightConfig)

    def describe(self):
        return f"smoothquant alpha={self.alpha:g} ({self.base.describe()})"
