"""Float8TrainingLinear: an nn.Linear that trains in float8 (e4m3 forward, e5m2 or e4m3 gradients), master weights in
float. enable_float8_training_ changes a Linear's class in place (identity, hooks and Parameters stay).

Three matmuls per step, each on float8 operands (see float8_matmul.py):
  forward   y      = x (M, K)  @ W^T (K, N)     e4m3 x e4m3, scales: x per tensor / per row, W per tensor / per row
  backward  grad_x = g (M, N)  @ W   (N, K)     G x e4m3, scales: g per tensor / per row, W per tensor / per column
            grad_W = g^T (N, M) @ x  (M, K)     G x e4m3, scales: g per tensor / per column, x per tensor / per column
G, the gradients' format, is e5m2 (the default: range for gradients) or e4m3fn (``grad_dtype=``: precision, with its
own scale, dynamic or delayed like the others, or static).
"Row" scaling scales each operand along a dimension its product keeps (never the one it sums over), so every
operand is cast again from its float value with the scales that matmul needs, as torchao's rowwise recipe does.
Delayed scaling (per tensor only) takes each scale from the largest amax of the last ``history_len`` steps (the
current amax on the first step) and records the current amax afterwards; values beyond it saturate.
Static scaling (per tensor only): Note [Static float8 training scales].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.qdtype import float8_e4m3fn, qdtype_from_name
from .float8_matmul import cast_to_float8, record_saturation, scaled_mm

__all__ = ["Float8TrainingLinear", "Float8TrainingState", "float8_training_class"]

X, W, GRAD = 0, 1, 2  # rows of the amax history, the static scales and their saturation counts

# Note [Static float8 training scales]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# recipe="static" casts the input, the weight and the output gradient of every step with three fixed per-tensor
# scales, buffer ``fp8_static_scales`` (input, weight, grad_output; saved in the state dict): given to
# enable_float8_training_ (``static_scales=``), or set by a calibration pass (``float8_training_calibration``: the
# layers run their float matmuls, record each tensor's amax, and on exit take scale = margin * amax / max of the
# tensor's format). No scale is computed from the current tensor, so no amax reduction sits before the casts. Values
# past scale * max saturate at the format's max (quantize_affine's clamp, the same cast as the other recipes), and
# each cast adds to the non-persistent buffer ``fp8_overflow`` (3, 3): per tensor, the casts that saturated, the
# elements that saturated, and the largest amax seen as a multiple of the representable range (> 1: saturated);
# ``float8_training_overflows(model)`` reports them. A layer with no scales yet refuses to run (never a silent
# dynamic scale).


@dataclass
class Float8TrainingState:
    recipe: str                 # "dynamic" | "delayed" | "static"
    granularity: str            # "tensor" | "row"
    original_class: type
    grad_dtype: str = "float8_e5m2"  # the gradients' float8 format: "float8_e5m2" | "float8_e4m3fn"
    name: str = ""                   # the module's name in the model it was enabled on, for errors and reports
    static_ready: bool = False       # static: the scales are set (given, calibrated or loaded)
    calibration_amax: torch.Tensor | None = None  # static, inside float8_training_calibration: (3,) amax so far


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
    # history: the delayed recipe's amax history, else None; scales (3,) and overflow (3, 3): the static recipe's
    # buffers, else None; grad_dtype: the gradients' qdtype name (a string: a constant for torch.compile).
    @staticmethod
    def forward(ctx, x2d, weight, history, scales, overflow, granularity, grad_dtype):
        rows = granularity == "row"
        if scales is not None:
            sx, sw = scales[X].reshape(1, 1), scales[W].reshape(1, 1)
            record_saturation(overflow, X, x2d, float8_e4m3fn, sx)
            record_saturation(overflow, W, weight, float8_e4m3fn, sw)
        elif history is None:
            sx = sw = None
        else:
            sx, sw = _delayed_scale(history, X, x2d, float8_e4m3fn), _delayed_scale(history, W, weight, float8_e4m3fn)
        xq = cast_to_float8(x2d, float8_e4m3fn, (1, x2d.shape[1]) if rows else x2d.shape, sx)
        # W^T (K, N): per-row scales of W are per-column scales of W^T.
        wq = cast_to_float8(weight.t(), float8_e4m3fn, (weight.shape[1], 1) if rows else weight.shape[::-1], sw)
        ctx.save_for_backward(x2d, weight)
        ctx.history, ctx.static, ctx.granularity, ctx.scales = history, (scales, overflow), granularity, (sx, sw)
        ctx.grad_dtype = grad_dtype
        return scaled_mm(xq, wq, x2d.dtype)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        history, rows = ctx.history, ctx.granularity == "row"
        gdt = qdtype_from_name(ctx.grad_dtype)
        sx, sw = ctx.scales
        scales, overflow = ctx.static
        if scales is not None:
            sg = scales[GRAD].reshape(1, 1)
            record_saturation(overflow, GRAD, grad, gdt, sg)
        else:
            sg = None if history is None else _delayed_scale(history, GRAD, grad, gdt)
        m, n = grad.shape
        k = x2d.shape[1]
        gq = cast_to_float8(grad, gdt, (1, n) if rows else (m, n), sg)
        wq = cast_to_float8(weight, float8_e4m3fn, (n, 1) if rows else (n, k), sw)
        grad_x = scaled_mm(gq, wq, grad.dtype)
        gtq = cast_to_float8(grad.t(), gdt, (1, m) if rows else (n, m), sg)
        xq = cast_to_float8(x2d, float8_e4m3fn, (m, 1) if rows else (m, k), sx)
        grad_w = scaled_mm(gtq, xq, weight.dtype)
        return grad_x, grad_w, None, None, None, None, None


def _short(name: str) -> str:
    return name.removeprefix("float8_").removesuffix("fn")  # "float8_e4m3fn" -> "e4m3", "float8_e5m2" -> "e5m2"


class Float8TrainingLinear(nn.Linear):
    """An ``nn.Linear`` that trains in float8: e4m3 activations and weights in the forward, e5m2 (or e4m3) gradients
    in the backward, master weights in float.

    ``enable_float8_training_`` turns a Linear into one by changing its class in place (identity, hooks and
    Parameters stay); its recipe, granularity and gradient format are in ``module.fp8``. The three matmuls of a step
    (forward, input gradient, weight gradient) each cast their operands to float8 with per-tensor or per-row /
    per-column scales; delayed scaling takes each scale from the largest amax of the last ``history_len`` steps;
    static scaling uses three fixed per-tensor scales (buffer ``fp8_static_scales``: input, weight, grad_output)
    and counts what saturates (``float8_training_overflows``). Not normally built directly.
    ``isinstance(m, qk.Float8TrainingLinear)`` finds converted layers.

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
        state = self.fp8
        scales = overflow = None
        if state.recipe == "static":
            if state.calibration_amax is not None:
                return self._calibration_forward(x)
            if not state.static_ready:
                raise RuntimeError(
                    f"{state.name or type(self).__name__}: float8 training with recipe='static' has no scales yet; "
                    f"pass static_scales= to enable_float8_training_, or run a few training steps inside "
                    f"`with torchqkit.float8_training_calibration(model):` first")
            scales, overflow = self.fp8_static_scales, self.fp8_overflow
        history = getattr(self, "fp8_amax_history", None)
        y = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), self.weight, history, scales, overflow, state.granularity,
                                state.grad_dtype)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias

    def _calibration_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The float linear, recording the amax of the input, the weight and (in the backward) the output gradient
        (Note [Static float8 training scales])."""
        amax = self.fp8.calibration_amax
        with torch.no_grad():
            amax[X] = torch.maximum(amax[X], x.detach().abs().amax().float())
            amax[W] = torch.maximum(amax[W], self.weight.detach().abs().amax().float())
        y = F.linear(x, self.weight)  # the bias after: grad_output is the gradient of the matmul's output

        def record_grad(g):
            with torch.no_grad():
                amax[GRAD] = torch.maximum(amax[GRAD], g.detach().abs().amax().float())

        if y.requires_grad:
            y.register_hook(record_grad)
        return y if self.bias is None else y + self.bias

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.fp8.recipe == "static" and prefix + "fp8_static_scales" in state_dict:
            # Loaded scales are set scales: the layer runs (a checkpoint of an uncalibrated layer holds zeros).
            self.fp8.static_ready = bool((self.fp8_static_scales > 0).all() & self.fp8_static_scales.isfinite().all())

    def extra_repr(self) -> str:
        from .float8_matmul import matmul_backend
        backend, _ = matmul_backend(self.weight.device)
        return (f"{super().extra_repr()}, float8 training ({self.fp8.recipe} {self.fp8.granularity} scales, "
                f"e4m3 forward, {_short(self.fp8.grad_dtype)} gradients, matmul: {backend})")


_CLASSES: dict[type, type] = {nn.Linear: Float8TrainingLinear}


def float8_training_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Float8Training{cls.__name__}", (Float8TrainingLinear, cls), {"__module__": __name__})
    return _CLASSES[cls]
