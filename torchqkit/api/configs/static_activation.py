"""Static activation scales: Int8StaticActivationInt8WeightConfig, and the observer fields it shares with
Float8StaticActivationFloat8WeightConfig.

A static config takes its per-tensor activation scale as ``act_scale``, or, left None, from calibration data
(``quantize_(..., calibration_data=batches)``): the observer sees every input of the Linear and sets
scale = range / qmax, the range being max|x| ("minmax"), the ``percentile``-th percentile of |x|, or the range
that minimises the Linear's output error ("mse", see Note [MSE-optimal activation range] in
algorithms/observers.py).

Note [Static int8 needs smoothing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One int8 scale per tensor, fixed before the data is seen, has 255 levels for every token. LLM Linear inputs
have channels (and a few tokens) far outside the typical range: on SmolLM2 the down_proj input of layer 11 reaches
3215 on a few tokens while a typical token's max is 1.5, so min/max puts the step at 25 and every ordinary value
rounds to zero (``python -m benchmarks calibration --outliers``: down_proj inputs are the worst in 12 of 12); clipping to the typical range (percentile, or the MSE search alone) destroys those tokens
instead. Per-token dynamic scales don't have this problem, which is why static scales alone were 35x dynamic's
perplexity increase there. SmoothQuant (Xiao et al., 2022) moves each channel's range into the weights with
s_j = max|x_j|^a / max|w_j|^(1 - a) before the scale is observed; the paper's per-tensor static setting (O3) uses
it, and llm-compressor's int8 W8A8 recipes pair it with a strength of 0.8. So ``smoothing`` (the strength a) is
on by default, at 0.8, when the scale is calibrated; ``smoothing=None`` observes the raw inputs. Wrapped in
SmoothQuantConfig, the wrapper's alpha is the one used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...core.granularity import PerRow, PerTensor
from ...core.primitives import MappingType
from ...core.qdtype import int8
from ...layouts.base import Layout
from ...layouts.plain import PlainLayout
from ...tensor.activation import ActivationQuantSpec
from ..quantize_weight import UnsupportedWeight, quantize_weight
from .base import QuantConfig, register_config

__all__ = ["Int8StaticActivationInt8WeightConfig", "Observer", "needs_static_scale"]

Observer = Literal["minmax", "percentile", "mse"]


def needs_static_scale(config, weight, name) -> None:
    if config.act_scale is None:
        raise UnsupportedWeight(f"{name}: {type(config).__name__}(act_scale=None) takes its activation scale from "
                                f"calibration data, and {name} was not calibrated; pass act_scale=..., or "
                                f"calibration_data=... to quantize_ with the Linear inside the model's decoder blocks")


def _int8_static_transform(config, weight, name):
    needs_static_scale(config, weight, name)
    act = ActivationQuantSpec(int8, PerTensor(), MappingType.SYMMETRIC, static_scale=config.act_scale)
    return quantize_weight(weight, int8, PerRow(), config.layout, mapping=MappingType.SYMMETRIC, act_quant=act,
                           kernel_preference=config.kernel_preference, name=name)


@register_config(_int8_static_transform)
@dataclass(frozen=True, kw_only=True)
class Int8StaticActivationInt8WeightConfig(QuantConfig):
    """int8 activations with one static per-tensor symmetric scale x int8 per-channel symmetric weights.

    The activation scale is fixed before the data is seen: given as ``act_scale``, or, left None, calibrated
    from the inputs passed to ``quantize_(..., calibration_data=...)`` by ``observer``, after SmoothQuant scaling of
    strength ``smoothing`` (on by default, since one static int8 scale per tensor is ruined by an LLM's outlier
    channels). A Linear that needs calibration but was not calibrated stays in float, and the report says why.

    Args:
        act_scale (float | None): the activation's per-tensor scale, a finite number > 0; None (default): calibrated.
        smoothing (float | None): SmoothQuant strength in [0, 1] applied before a calibrated scale is observed;
            default 0.8; None: observe the raw inputs. Inside ``SmoothQuantConfig`` the wrapper's ``alpha`` is used.
        observer (str): how a calibrated scale is chosen: ``"minmax"`` (default; max|x|), ``"percentile"`` (the
            ``percentile``-th percentile of |x|) or ``"mse"`` (the range minimising the Linear's output error).
        percentile (float): the percentile for ``observer="percentile"``, in (0, 100]; default 99.99.
        layout (Layout): how the weight codes are stored; default ``PlainLayout()``; a layout name is accepted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: ``act_scale`` <= 0 or not finite, ``smoothing`` outside [0, 1], ``percentile`` out of range,
            or an unknown observer.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Int8StaticActivationInt8WeightConfig(), calibration_data=batches)
        fixed = qk.Int8StaticActivationInt8WeightConfig(act_scale=0.02)
        ```
    """
    act_scale: float | None = field(default=None, metadata={"gt": 0.0})
    smoothing: float | None = field(default=0.8, metadata={"ge": 0.0, "le": 1.0})
    observer: Observer = "minmax"
    percentile: float = field(default=99.99, metadata={"gt": 0.0, "le": 100.0})
    layout: Layout = field(default_factory=PlainLayout)

    def needs_calibration_data(self) -> bool:
        return self.act_scale is None

    def describe(self):
        scale = f"scale {self.act_scale:g}" if self.act_scale is not None else f"calibrated {self.observer}"
        if self.act_scale is None and self.smoothing is not None:
            scale += f", smoothing {self.smoothing:g}"
        return f"int8 static act ({scale}) x int8 weight"
