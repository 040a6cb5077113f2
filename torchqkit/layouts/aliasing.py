"""return_view: the result of a view op on a quantized tensor, aliased to its input, also under torch.inference_mode.

Note [Views under inference mode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A view op of a wrapper subclass (``w.t()``, ``w.detach()``, ``stack[e]``, ``stack.transpose(-2, -1)``) returns a new
wrapper and ``return_and_correct_aliasing`` makes it share the input's storage and version counter. Inside
``torch.inference_mode()`` a tensor made there is an inference tensor, which has no version counter, so for a weight
made outside inference mode (every quantized model: ``quantize_`` runs outside it) that step raises "Cannot set
version_counter for inference tensor" (pytorch/pytorch#112024, #170419), which would stop transformers' MoE experts,
an inference server's ``torch.inference_mode()`` and any ``x @ w.t()`` there. Torch's own rule for a view of a normal
tensor taken in inference mode is that the view is a normal tensor; ``return_view`` builds the result outside
inference mode in that case, which is exactly that. A tensor made inside inference mode is viewed there as before.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

__all__ = ["return_view"]


def return_view(func, args, kwargs, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``return_and_correct_aliasing(func, args, kwargs, make())``, also for a normal tensor viewed under
    torch.inference_mode (Note [Views under inference mode]). ``make`` builds the view's wrapper."""
    if torch.is_inference_mode_enabled() and not args[0].is_inference():
        with torch.inference_mode(False):
            return return_and_correct_aliasing(func, args, kwargs, make())
    return return_and_correct_aliasing(func, args, kwargs, make())
