"""Reversible edits of a decoder block's float parameters during calibration, and the checks around them: the
parameters calibration replaces (restored at the end, or adopted by quantize_), norms found by kind, scales folded
into the op that produces an input, and the block's output before and after (folding must not change it)."""
from __future__ import annotations

import torch
from torch import nn

from ..algorithms.blockwise import run_block

__all__ = ["Undo", "is_norm", "fold_scales", "block_output", "same_function"]


class Undo:
    """Parameters replaced during calibration, restored at the end."""

    def __init__(self):
        self.saved: dict[tuple[int, str], tuple[nn.Module, str, nn.Parameter]] = {}

    def set(self, module: nn.Module, attr: str, value: torch.Tensor) -> None:
        self.saved.setdefault((id(module), attr), (module, attr, getattr(module, attr)))
        setattr(module, attr, nn.Parameter(value, requires_grad=False))

    def adopt(self, other: "Undo") -> None:
        """Take over ``other``'s changes (the originals recorded first stay the ones restored)."""
        for key, entry in other.saved.items():
            self.saved.setdefault(key, entry)

    def restore(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Put every original back; return what was there instead, (module, attr, new value)."""
        changed = []
        for module, attr, original in self.saved.values():
            changed.append((module, attr, getattr(module, attr)))
            setattr(module, attr, original)
        return changed


def is_norm(m: nn.Module) -> bool:
    """An elementwise affine norm (LayerNorm, RMSNorm): y = normalize(x) * weight (+ bias)."""
    w = getattr(m, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 1 and not isinstance(m, (nn.Linear, nn.Embedding))
            and "norm" in type(m).__name__.lower())


def fold_scales(target: nn.Module, s: torch.Tensor, undo: Undo) -> None:
    """x / s: a norm's weight (and bias) divided by s, or a Linear's output rows (and bias)."""
    w = target.weight.detach()
    scaled = (w.float() / s.unsqueeze(1)) if isinstance(target, nn.Linear) else (w.float() / s)
    undo.set(target, "weight", scaled.to(w.dtype))
    bias = getattr(target, "bias", None)
    if isinstance(bias, torch.Tensor):
        undo.set(target, "bias", (bias.detach().float() / s).to(bias.dtype))


def block_output(block, inp) -> torch.Tensor:
    out = run_block(block, [inp])[0]
    out = out.args[0] if out.args else next(iter(out.kwargs.values()))
    # a whole model's output: a ModelOutput / dict (logits, embeddings, ...): its first tensor
    return next(v for v in out.values() if isinstance(v, torch.Tensor)) if isinstance(out, dict) else out


def same_function(out: torch.Tensor, reference: torch.Tensor) -> bool:
    """Folding scales must leave the float block's function alone (up to float rounding, ~1e-7 relative)."""
    return bool((out - reference).norm() <= 1e-4 * reference.norm())
