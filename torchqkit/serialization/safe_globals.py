"""Safe globals, so ``torch.load(weights_only=True)`` rebuilds quantized state dicts without
unpickling arbitrary code. Every non-tensor object an AffineQuantizedTensor holds is listed here."""
from __future__ import annotations

import torch

from ..core import granularity
from ..core.primitives import MappingType, ZeroPointDomain
from ..core.qdtype import qdtype_from_name
from ..layouts.base import all_layouts
from ..tensor.activation import ActivationQuantSpec, KernelPreference
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor

__all__ = ["register_safe_globals"]


def register_safe_globals() -> None:
    torch.serialization.add_safe_globals([
        AffineQuantizedTensor, qdtype_from_name, MappingType, ZeroPointDomain, KernelPreference,
        ActivationQuantSpec, granularity.PerTensor, granularity.PerAxis, granularity.PerGroup, granularity.PerRow,
        granularity.PerToken, granularity.PerBlock, *all_layouts(),
    ])
