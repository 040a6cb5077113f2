"""Observers: what a Linear's inputs looked like during calibration, for static scales and the algorithms.

``InputStats`` keeps, over every calibration token row x (K,) of one Linear input: the per-channel max |x|
(static min/max scales, SmoothQuant), the per-channel mean |x| (AWQ), the per-channel sum of x^2 (Wanda's
||X_col||_2), optionally the Hessian 2/n sum x x^T
(GPTQ), and a seeded sample of at most ``max_rows`` rows (AWQ's searches, percentile and MSE ranges).

A static per-tensor activation range is chosen by ``static_range``: "minmax" (max |x|, nothing clipped),
"percentile" (clips the rarest values) or "mse" (see Note [MSE-optimal activation range]).
"""
from __future__ import annotations

import torch

from collections.abc import Callable

from .gptq import HessianAccumulator

__all__ = ["InputStats", "static_range", "static_activation_scale", "mse_range"]

# Note [MSE-optimal activation range]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# One static scale serves every token, and max |x| is often set by a few tokens (massive activations, e.g. a
# delimiter's down_proj input is 1000x the typical value): the step then rounds every ordinary token to zero.
# Clipping everything (percentile) destroys those few tokens instead. The "mse" observer takes the range r that
# minimises the expected error of the Linear's *output* over the sampled calibration rows: for rounding errors
# e (T, K) of x, E||e W^T||^2 ~= sum_j ||e_:j||^2 ||W_:j||^2 when the errors of different channels are
# uncorrelated (the diagonal of GPTQ's X^T X picture), so each channel's squared error is weighted by its
# weight column's squared norm. Candidates, clipping included in the error: r = max|x| * 2^(-i / 2) down to
# 1/4096 of the max, then the best one refined by factors 2^(j / 16), |j| < 8 (25 + 15 evaluations of the
# format instead of 97 on the fine grid); r = max|x| is a candidate, so the search never does worse than
# minmax on its own objective.
MSE_COARSE, MSE_FINE = 24, 7


class InputStats:
    def __init__(self, in_features: int, total_rows: int, *, hessian: bool = False, max_rows: int = 4096,
                 seed: int = 0):
        self.absmax = torch.zeros(in_features)
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.sq_sum = torch.zeros(in_features, dtype=torch.float64)
        self.rows = 0
        self.hessian = HessianAccumulator(in_features) if hessian else None
        self.keep = min(1.0, max_rows / max(total_rows, 1))
        self.samples: list[torch.Tensor] = []
        self.generator = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if x.shape[0] == 0:
            return  # no tokens, no statistics (amax over 0 rows has no value)
        a = x.abs()
        self.absmax = torch.maximum(self.absmax, a.amax(dim=0))
        self.abs_sum += a.sum(dim=0, dtype=torch.float64)
        self.sq_sum += a.square().sum(dim=0, dtype=torch.float64)
        self.rows += x.shape[0]
        if self.hessian is not None:
            self.hessian.add(x)
        chosen = torch.rand(x.shape[0], generator=self.generator) < self.keep
        self.samples.append(x[chosen].clone())

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.rows, 1)).float()

    def sample(self) -> torch.Tensor:
        return torch.cat(self.samples) if self.samples else torch.zeros(0, self.absmax.numel())


def static_range(stats: InputStats, observer: str, percentile: float, smooth: torch.Tensor | None = None, *,
                 fake_quantize: Callable[[torch.Tensor, float], torch.Tensor] | None = None,
                 weight: torch.Tensor | None = None) -> float:
    """The activation range a static per-tensor scale covers: max |x / smooth| ("minmax", exact over every row),
    the ``percentile``-th percentile of |x / smooth| over the sampled rows ("percentile"), or the range that
    minimises the Linear's output error ("mse": needs ``fake_quantize(x, r)`` and the ``weight`` (N, K) the
    input meets, see Note [MSE-optimal activation range])."""
    s = torch.ones_like(stats.absmax) if smooth is None else smooth.float()
    if observer == "minmax":
        return float((stats.absmax / s).max())
    if observer == "mse":
        if fake_quantize is None or weight is None:
            raise ValueError("the 'mse' observer needs the activation format (fake_quantize) and the Linear's weight")
        return mse_range(stats.sample() / s, float((stats.absmax / s).max()), fake_quantize, weight)
    values = (stats.sample() / s).abs().flatten()
    if values.numel() > 8_000_000:  # torch.quantile's input limit is 16M; a strided subset keeps it exact enough
        values = values[:: -(-values.numel() // 8_000_000)]
    return float(torch.quantile(values, percentile / 100.0))


def static_activation_scale(config, stats: InputStats, smooth: torch.Tensor | None, weight: torch.Tensor
                            ) -> tuple[float, float]:
    """(range, scale) of a static activation config's per-tensor scale (``Int8StaticActivationInt8WeightConfig`` /
    ``Float8StaticActivationFloat8WeightConfig``: its ``observer``, ``percentile`` and activation dtype) for the
    inputs ``stats`` (divided by ``smooth``) of a Linear of ``weight``: scale = range / the format's largest code."""
    from ..core.granularity import PerTensor
    from ..core.qdtype import int8
    from ..tensor.activation import ActivationQuantSpec
    qdtype = getattr(config, "activation_dtype", int8)
    qmax = float(qdtype.qmax)

    def fake_quantize(x, r):
        return ActivationQuantSpec(qdtype, PerTensor(), static_scale=max(r, 1e-12) / qmax).fake_quantize(x)

    r = static_range(stats, config.observer, config.percentile, smooth, fake_quantize=fake_quantize, weight=weight)
    return r, max(r, 1e-12) / qmax


def mse_range(x: torch.Tensor, absmax: float, fake_quantize: Callable[[torch.Tensor, float], torch.Tensor],
              weight: torch.Tensor) -> float:
    """The range r (<= absmax) whose static quantization of rows x (T, K) gives the smallest weighted squared
    error sum_j ||fake_quantize(x, r)_:j - x_:j||^2 ||W_:j||^2 (see Note [MSE-optimal activation range])."""
    if x.numel() == 0 or absmax <= 0:
        return absmax
    x = x.float()
    column_weight = weight.detach().float().square().sum(dim=0)  # (K,)

    def err(r):
        return float(((fake_quantize(x, r) - x).square().sum(dim=0) * column_weight).sum())

    coarse = min((absmax * 2.0 ** (-i / 2) for i in range(MSE_COARSE + 1)), key=err)
    fine = [coarse * 2.0 ** (j / 16) for j in range(-MSE_FINE, MSE_FINE + 1)]
    return min((r for r in fine if r <= absmax), key=err)
