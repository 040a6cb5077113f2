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
from .dynamic_activation import Int8DynamicActivationInt8WeightConfig, Int8DynamicActivationIntxWeightConfig
from .float8 import Float8DynamicActivationFloat8WeightConfig, Float8StaticActivationFloat8WeightConfig
from .int4_dynamic_activation import Float8DynamicActivationInt4WeightConfig, Int4DynamicActivationInt4WeightConfig
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
    """GPTQ: choose ``base``'s integer codes from calibration data, column by column, compensating the error.

    The weight keeps ``base``'s qparams grid and layout, but its codes are chosen by GPTQ using the Hessian of
    the Linear's inputs, collected from ``quantize_(..., calibration_data=...)``. The result is ``base``'s ordinary
    quantized weight, so the same kernels and checkpoints serve it. A weight quantized without calibration (by
    ``quantize_checkpoint``, say) is refused and stays in float; the report says why.

    Args:
        base (QuantConfig): the weight config whose grid GPTQ fills: an ``Int4WeightOnlyConfig`` (default
            ``Int4WeightOnlyConfig()``), ``IntxWeightOnlyConfig``, ``Int8WeightOnlyConfig``, or a dynamic-activation
            config: ``Int8DynamicActivationInt8WeightConfig``, ``Int8DynamicActivationIntxWeightConfig`` (W4A8:
            its bits, group size and mapping are the grid), ``Int4DynamicActivationInt4WeightConfig`` or
            ``Float8DynamicActivationInt4WeightConfig``. Their activations are quantized at run time as the base
            says; the Hessian comes from each Linear's unrounded input (Note [GPTQ Hessians under dynamic
            activations], api/calibrate.py). The only argument that may be given by position.
        damp (float): fraction of the mean Hessian diagonal added to the diagonal, in (0, 1]; default 0.01.
        block (int): columns per lazy batch update, >= 1; default 128.
        act_order (bool): process columns by decreasing Hessian diagonal (implies static groups); default False.
        static_groups (bool): every group's qparams from the original weight, not the updated one; default False.
        true_sequential (bool): inside a decoder block, calibrate each set of Linears sharing an input after the
            ones before it are quantized (o_proj's Hessian from quantized q/k/v, down_proj's from quantized
            gate/up); one block pass each. Default False.
        kernel_preference (KernelPreference): not used: the wrapped config's ``kernel_preference`` is the one
            that applies. Default ``KernelPreference.AUTO``.

    Raises:
        TypeError: ``base`` is not one of the accepted configs, or a field of the wrong type.
        ValueError: ``damp`` or ``block`` out of range.

    Example:
        ```python
        import torchqkit as qk
        config = qk.GPTQConfig(qk.Int4WeightOnlyConfig(group_size=128), act_order=True)
        report = qk.quantize_(model, config, calibration_data=batches)
        # or W4A8: int8 dynamic activations x int4 weights whose codes GPTQ chooses
        w4a8 = qk.Int8DynamicActivationIntxWeightConfig(weight_bits=4, weight_granularity=qk.PerGroup(32))
        config = qk.GPTQConfig(w4a8)
        ```
    """
    damp: float = field(default=0.01, metadata={"gt": 0.0, "le": 1.0})
    block: int = field(default=128, metadata={"ge": 1})
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = False
    BASES = (Int4WeightOnlyConfig, IntxWeightOnlyConfig, Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
             Int8DynamicActivationIntxWeightConfig, Int4DynamicActivationInt4WeightConfig,
             Float8DynamicActivationInt4WeightConfig)

    def describe(self):
        order = (" act-order" if self.act_order else "") + (" true-sequential" if self.true_sequential else "")
        return f"gptq{order} ({self.base.describe()})"


@register_config(_needs_calibration)
@dataclass(frozen=True, kw_only=True)
class AWQConfig(CalibratedConfig):
    """AWQ: activation-aware scaling of ``base``'s weights, from calibration data.

    Per input channel scales s = mean|x|^r (r searched on ``n_grid`` points) multiply the weight's columns and
    divide the previous norm or Linear (folded into it), so the channels that matter most lose less to rounding.
    With ``clip`` it also searches, per group, how far to shrink the weight range (not for attention query / key
    projections). The result is ``base``'s ordinary quantized weight. Needs ``calibration_data``; a Linear that was
    not calibrated is refused and stays in float. Mixture-of-experts expert Parameters are calibrated per expert on
    the tokens routed to it (docs: guides/moe.md, "AWQ per expert").

    Args:
        base (QuantConfig): the weight config: ``Int4WeightOnlyConfig`` (default ``Int4WeightOnlyConfig()``),
            ``IntxWeightOnlyConfig`` or ``NF4WeightOnlyConfig``. The only argument that may be given by position.
        n_grid (int): points of the search for the exponent r, >= 2; default 20.
        clip (bool): also search a per-group clipping of the weight range; default True.
        kernel_preference (KernelPreference): not used: the wrapped config's ``kernel_preference`` is the one
            that applies. Default ``KernelPreference.AUTO``.

    Raises:
        TypeError: ``base`` is not one of the accepted configs, or a field of the wrong type.
        ValueError: ``n_grid`` below 2.

    Example:
        ```python
        import torchqkit as qk
        config = qk.AWQConfig(qk.Int4WeightOnlyConfig(group_size=128), n_grid=20)
        report = qk.quantize_(model, config, calibration_data=batches)
        ```
    """
    base: QuantConfig = field(default_factory=Int4WeightOnlyConfig, kw_only=False)
    n_grid: int = field(default=20, metadata={"ge": 2})
    clip: bool = True
    BASES = (Int4WeightOnlyConfig, IntxWeightOnlyConfig, NF4WeightOnlyConfig)

    def describe(self):
        return f"awq{' +clip' if self.clip else ''} ({self.base.describe()})"


@register_config(_needs_calibration)
@dataclass(frozen=True, kw_only=True)
class SmoothQuantConfig(CalibratedConfig):
    """SmoothQuant: move activation outliers into the weights before ``base`` quantizes them.

    Per input channel s = max|x|^alpha / max|w|^(1 - alpha), from calibration data: the input is divided by s
    (folded into the previous norm or Linear) and the weight's columns multiplied by it, so int8 / float8
    activations lose less to outlier channels. The result is ``base``'s ordinary quantized weight. Needs
    ``calibration_data``; a Linear that was not calibrated is refused and stays in float.

    Args:
        base (QuantConfig): the activation-quantizing config: ``Int8DynamicActivationInt8WeightConfig`` (default
            ``Int8DynamicActivationInt8WeightConfig()``), ``Int8StaticActivationInt8WeightConfig``,
            ``Float8DynamicActivationFloat8WeightConfig`` or ``Float8StaticActivationFloat8WeightConfig``. The only
            argument that may be given by position.
        alpha (float): migration strength in [0, 1]; default 0.5.
        kernel_preference (KernelPreference): not used: the wrapped config's ``kernel_preference`` is the one
            that applies. Default ``KernelPreference.AUTO``.

    Raises:
        TypeError: ``base`` is not one of the accepted configs, or a field of the wrong type.
        ValueError: ``alpha`` outside [0, 1].

    Example:
        ```python
        import torchqkit as qk
        config = qk.SmoothQuantConfig(qk.Int8DynamicActivationInt8WeightConfig(), alpha=0.5)
        report = qk.quantize_(model, config, calibration_data=batches)
        ```
    """
    base: QuantConfig = field(default_factory=Int8DynamicActivationInt8WeightConfig, kw_only=False)
    alpha: float = field(default=0.5, metadata={"ge": 0.0, "le": 1.0})
    BASES = (Int8DynamicActivationInt8WeightConfig, Int8StaticActivationInt8WeightConfig,
             Float8DynamicActivationFloat8WeightConfig, Float8StaticActivationFloat8WeightConfig)

    def describe(self):
        return f"smoothquant alpha={self.alpha:g} ({self.base.describe()})"
