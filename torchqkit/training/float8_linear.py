"""Float8TrainingLinear: an nn.Linear that trains in float8 (e4m3 forward, e5m2 gradients), master weights in
float. enable_float8_training_ changes a Linear's class in place (identity, hooks and Parameters stay).

Three matmuls per step, each on float8 operands (see float8_matmul.py):
  forward   y      = x (M, K)  @ W^T (K, N)     e4m3 x e4m3, scales: x per tensor / per row, W per tensor / per row
  backward  grad_x = g (M, N)  @ W   (N, K)     e5m2 x e4m3, scales: g per tensor / per row, W per tensor / per column
            grad_W = g^T (N, M) @ x  (M, K)     e5m2 x e4m3, scales: g per tensor / per column, x per tensor / per column
"Row" scaling scales each operand along a dimension its product keeps (never the one it sums over), so every
operand is cast again from its float value with the scales that matmul needs, as torchao's rowwise recipe does.
Delayed scaling (per tensor only) takes each scale from the largest amax of the last ``history_len`` steps (the
current amax on the first step) and records the current amax afterwards; values beyond it saturate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.qdtype import float8_e4m3fn, float8_e5m2
from .float8_matmul import cast_to_float8, scaled_mm

__all__ = ["Float8TrainingLinear", "Float8TrainingState", "float8_training_class"]

X, W, GRAD = 0, 1, 2  # rows of the amax history buffer


@dataclass
class Float8TrainingState:
    recipe: str                 # "dynamic" | "delayed"
    granularity: str            # "tensor" | "row"
    original_class: type


def _delayed_scale(history: torch.Tensor, row: int, t: torch.Tensor, qdtype) -> torch.Tensor:
    """The scale from the amax history (the current amax when the history is empty); records the current amax."""
    amax = t.detach().abs().amax().float()
    past = history[row].amax()
    scale = torch.where(past > 0, past, amax) / qdtype.max_abs_level
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).reshape(1, 1)
    with torch.no_grad():
        history[row].copy_(torch.cat([amax.reshape(1), history[row, :-1]]))
    return scale


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, history, granularity):
        rows = granularity == "row"
        if history is None:
            sx = sw = None
        else:
            sx, sw = _delayed_scale(history, X, x2d, float8_e4m3fn), _delayed_scale(history, W, weight, float8_e4m3fn)
        xq = cast_to_float8(x2d, float8_e4m3fn, (1, x2d.shape[1]) if rows else x2d.shape, sx)
        # W^T (K, N): per-row scales of W are per-column scales of W^T.
        wq = cast_to_float8(weight.t(), float8_e4m3fn, (weight.shape[1], 1) if rows else weight.shape[::-1], sw)
        ctx.save_for_backward(x2d, weight)
        ctx.history, ctx.granularity, ctx.scales = history, granularity, (sx, sw)
        return scaled_mm(xq, wq, x2d.dtype)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        history, rows = ctx.history, ctx.granularity == "row"
        sx, sw = ctx.scales
        sg = None if history is None else _delayed_scale(history, GRAD, grad, float8_e5m2)
        m, n = grad.shape
        k = x2d.shape[1]
        gq = cast_to_float8(grad, float8_e5m2, (1, n) if rows else (m, n), sg)
        wq = cast_to_float8(weight, float8_e4m3fn, (n, 1) if rows else (n, k), sw)
        grad_x = scaled_mm(gq, wq, grad.dtype)
        gtq = cast_to_float8(grad.t(), float8_e5m2, (1, m) if rows else (n, m), sg)
        xq = cast_to_float8(x2d, float8_e4m3fn, (m, 1) if rows else (m, k), sx)
        grad_w = scaled_mm(gtq, xq, weight.dtype)
        return grad_x, grad_w, None, None


class Float8TrainingLinear(nn.Linear):
    """An ``nn.Linear`` that trains in float8: e4m3 activations and weights in the forward, e5m2 gradients in the
    backward, master weights in float.

    ``enable_float8_training_`` turns a Linear into one by changing its class in place (identity, hooks and
    Parameters stay); its recipe and granularity are in ``module.fp8``. The three matmuls of a step (forward,
    input gradient, weight gradient) each cast their operands to float8 with per-tensor or per-row / per-column
    scales; delayed scaling takes each scale from the largest amax of the last ``history_len`` steps. Not normally
    built directly. ``isinstance(m, qk.Float8TrainingLinear)`` finds converted layers.

    Args:
        in_features (int): as ``nn.Linear``.
        out_features (int): as ``nn.Linear``.
        bias (bool): as ``nn.Linear``; default True.
        device (torch.device | None): as ``nn.Linear``; default None.
        dtype (torch.dtype | None): as ``nn.Linear``; default None.

    Example:
        ```python
        import torchqkit as qk
        qk.enable_float8_training_(model)
        converted = [n for n, m in model.named_modules() if isinstance(m, qk.Float8TrainingLinear)]
        ```
    """
    fp8: Float8TrainingState

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        history = getattr(self, "fp8_amax_history", None)
        y = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), self.weight, history, self.fp8.granularity)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        from .float8_matmul import matmul_backend
        backend, _ = matmul_backend(self.weight.device)
        return (f"{super().extra_repr()}, float8 training ({self.fp8.recipe} {self.fp8.granularity} scales, "
                f"e4m3 forward, e5m2 gradients, matmul: {backend})")


_CLASSES: dict[type, type] = {nn.Linear: Float8TrainingLinear}


def float8_training_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Float8Training{cls.__name__}", (Float8TrainingLinear, cls), {"__module__": __name__})
    return _CLASSES[cls]
