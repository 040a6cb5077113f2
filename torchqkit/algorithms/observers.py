"""Observers: what a Linear's inputs looked like during calibration, for static scales and the algorithms.

``InputStats`` keeps, over every calibration token row x (K,) of one Linear input: the per-channel max |x|
(static min/max scales, SmoothQuant), the per-channel mean |x| (AWQ), optionally the Hessian 2/n sum x x^T
(GPTQ), and a seeded sample of at most ``max_rows`` rows (AWQ's searches, percentile ranges).
"""
from __future__ import annotations

import torch

from .gptq import HessianAccumulator

__all__ = ["InputStats", "static_range"]


class InputStats:
    def __init__(self, in_features: int, total_rows: int, *, hessian: bool = False, max_rows: int = 4096,
                 seed: int = 0):
        self.absmax = torch.zeros(in_features)
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.rows = 0
        self.hessian = HessianAccumulator(in_features) if hessian else None
        self.keep = min(1.0, max_rows / max(total_rows, 1))
        self.samples: list[torch.Tensor] = []
        self.generator = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        a = x.abs()
        self.absmax = torch.maximum(self.absmax, a.amax(dim=0))
        self.abs_sum += a.sum(dim=0, dtype=torch.float64)
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


def static_range(stats: InputStats, observer: str, percentile: float, smooth: torch.Tensor | None = None) -> float:
    """The activation range a static per-tensor scale covers: max |x / smooth| ("minmax", exact over every row)
    or the ``percentile``-th percentile of |x / smooth| over the sampled rows ("percentile")."""
    s = torch.ones_like(stats.absmax) if smooth is None else smooth.float()
    if observer == "minmax":
        return float((stats.absmax / s).max())
    values = (stats.sample() / s).abs().flatten()
    if values.numel() > 8_000_000:  # torch.quantile's input limit is 16M; a strided subset keeps it exact enough
        values = values[:: -(-values.numel() // 8_000_000)]
    return float(torch.quantile(values, percentile / 100.0))
