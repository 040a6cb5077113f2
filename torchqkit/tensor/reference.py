"""The reference linear every layout can name explicitly: dequantize the weight (and fake-quantize the
activation when the weight carries an ActivationQuantSpec), then a float ``F.linear``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["reference_linear", "flatten_tokens"]


def flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K)."""
    return x.reshape(-1, x.shape[-1])


def reference_linear(w, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if w.act_quant is not None:
        x = w.act_quant.fake_quantize(flatten_tokens(x)).reshape(x.shape)
    return F.linear(x, w.dequantize(), bias)
