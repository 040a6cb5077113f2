"""Hooks that run at the end of ``quantize_``: what a framework wrapping the model must learn about its new weights.

transformers keeps how a model is quantized on the model itself (``model.hf_quantizer``,
``model.config.quantization_config``), and its ``save_pretrained`` trusts that record: a model it loaded from a
GGUF file still says "gguf, not serializable" after ``quantize_`` replaced every weight, and a model it loaded in
float tries to write the quantized tensors as plain ones. The transformers integration registers a hook here that
makes torchqkit the model's quantizer (integrations/transformers_quantizer.py); it is imported whenever
transformers loads its quantizers, so any transformers model ``quantize_`` sees has it, and this layer never
imports transformers. ``complete_quantization_`` runs no hook: transformers' own loader sets its quantizer then.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["register_after_quantize", "run_after_quantize"]

_HOOKS: list[Callable[[nn.Module, object], None]] = []


def register_after_quantize(hook: Callable[[nn.Module, object], None]) -> None:
    """``hook(model, config)`` runs at the end of every ``quantize_`` call (registering twice is a no-op)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)


def run_after_quantize(model: nn.Module, config) -> None:
    for hook in _HOOKS:
        hook(model, config)
