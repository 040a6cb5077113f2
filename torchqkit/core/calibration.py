"""Calibration methods: how the float range [lo, hi] of each block is chosen before scales are derived.

Spelled as strings so configs stay JSON-friendly:
  "absmax"          lo, hi = -max|x|, max|x|
  "minmax"          lo, hi = min(x), max(x)
  "rms,<k>"         min/max clipped to +-k * rms(x) of the block (k = 3 keeps ~3 sigma of a Gaussian)
  "fixed,<lo>,<hi>" the given constants (static activation ranges)
Each takes an optional trailing clipping factor that scales the range: "absmax,0.9", "rms,3,0.95".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Calibration", "parse_calibration"]

_ARGS = {"absmax": 0, "minmax": 0, "rms": 1, "fixed": 2}


@dataclass(frozen=True)
class Calibration:
    method: str
    args: tuple[float, ...] = ()
    clip: float = 1.0

    def block_range(self, blocks: torch.Tensor, reduce_dims: tuple[int, ...], valid: torch.Tensor | None = None):
        """(lo, hi) per block, in float32, reduced over ``reduce_dims`` with keepdim. ``valid`` (same shape as
        ``blocks``, or None for all) marks real elements: padding of a partial block counts in no statistic."""
        x = blocks.float()
        if valid is not None:
            x = x.masked_fill(~valid, 0.0)  # 0 leaves absmax and sums alone; min/max mask it below
        if self.method == "absmax":
            hi = x.abs().amax(dim=reduce_dims, keepdim=True)
            lo = -hi
        elif self.method in ("minmax", "rms"):
            lo, hi = self._min_max(x, reduce_dims, valid)
            if self.method == "rms":
                sq = x.square().sum(dim=reduce_dims, keepdim=True)
                count = (math.prod(x.shape[d] for d in reduce_dims) if valid is None
                         else valid.sum(dim=reduce_dims, keepdim=True))
                bound = self.args[0] * (sq / count).sqrt()
                lo, hi = torch.maximum(lo, -bound), torch.minimum(hi, bound)
        else:  # fixed
            shape = [1 if d in reduce_dims else s for d, s in enumerate(x.shape)]
            lo = torch.full(shape, self.args[0], dtype=torch.float32, device=x.device)
            hi = torch.full(shape, self.args[1], dtype=torch.float32, device=x.device)
        if self.clip != 1.0:
            lo, hi = lo * self.clip, hi * self.clip
        return lo, hi

    @staticmethod
    def _min_max(x, reduce_dims, valid):
        if valid is None:
            return x.amin(dim=reduce_dims, keepdim=True), x.amax(dim=reduce_dims, keepdim=True)
        lo = x.masked_fill(~valid, float("inf")).amin(dim=reduce_dims, keepdim=True)
        hi = x.masked_fill(~valid, float("-inf")).amax(dim=reduce_dims, keepdim=True)
        return lo, hi

    def __str__(self) -> str:
        parts = [self.method, *(f"{a:g}" for a in self.args)]
        if self.clip != 1.0:
            parts.append(f"{self.clip:g}")
        return ",".join(parts)


def parse_calibration(spec: str | Calibration) -> Calibration:
    if isinstance(spec, Calibration):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"calibration must be a string such as 'absmax' or 'rms,3', got {spec!r}")
    method, *rest = [p.strip() for p in spec.split(",")]
    if method not in _ARGS:
        raise ValueError(f"unknown calibration method {method!r} in {spec!r}; known: {sorted(_ARGS)}")
    need = _ARGS[method]
    if len(rest) not in (need, need + 1):
        raise ValueError(f"calibration {spec!r}: {method!r} takes {need} number(s) plus an optional clipping factor")
    try:
        nums = [float(v) for v in rest]
    except ValueError:
        raise ValueError(f"calibration {spec!r}: arguments must be numbers") from None
    args, clip = tuple(nums[:need]), (nums[need] if len(nums) > need else 1.0)
    if not 0.0 < clip <= 1.0:
        raise ValueError(f"calibration {spec!r}: clipping factor must be in (0, 1], got {clip}")
    if method == "rms" and args[0] <= 0:
        raise ValueError(f"calibration {spec!r}: rms multiple must be positive")
    if method == "fixed" and not args[0] < args[1]:
        raise ValueError(f"calibration {spec!r}: fixed range needs lo < hi")
    return Calibration(method, args, clip)
