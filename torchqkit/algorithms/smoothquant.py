"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights before int8 / float8 quantization.

Per input channel j, s_j = max|x_j|^alpha / max|w_j|^(1 - alpha); the Linear computes (x / s)(W s)^T, the same
function, with x / s folded into the op that produces x. alpha = 0 leaves the activations alone, alpha = 1
moves all of their range into the weights; 0.5 balances the two (the paper's default for most models).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["smoothing_scales"]


def smoothing_scales(act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """s (K,) for Linears of weights (N_i, K) sharing an input whose per-channel max |x| is act_absmax (K,).
    Channels whose activations or weights are all zero keep s = 1 (nothing to balance)."""
    w_absmax = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    a = act_absmax.float()
    s = a.pow(alpha) / w_absmax.pow(1 - alpha)
    ok = (a > 0) & (w_absmax > 0) & torch.isfinite(s)
    return torch.where(ok, s.clamp(min=1e-5), torch.ones_like(s))
