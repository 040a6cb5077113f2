"""FakeQuantizedLinear: an nn.Linear whose forward fake-quantizes its weight (and input, for configs that
quantize activations) as the quantized layer will compute, with straight-through gradients.

prepare_qat_ turns a Linear into one by changing its class in place, not by building a new module: the
module keeps its identity, hooks, Parameters and state-dict keys (``weight``, ``bias``), so the training
state is the plain float state dict. convert_qat_ changes the class back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..api.configs.base import QuantConfig
from .fake_quantize import WeightFakeQuantizer, fake_quantize_activation

__all__ = ["FakeQuantizedLinear", "QATState", "fake_quantized_class"]


@dataclass
class QATState:
    config: QuantConfig              # what convert_qat_ quantizes this layer with
    original_class: type             # the module's class before prepare_qat_
    weight_quantizer: WeightFakeQuantizer
    clipped: bool                    # clipped-STE gradients for the activation too


class FakeQuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward fake-quantizes its weight (and input, for configs that quantize activations)
    as the quantized layer will compute, with straight-through gradients.

    ``prepare_qat_`` turns a Linear into one by changing its class in place (a subclass of the Linear's own class
    when it isn't ``nn.Linear`` itself), so the module keeps its identity, hooks, Parameters and state-dict keys,
    and the training state is the plain float state dict; ``convert_qat_`` changes the class back. Not normally
    built directly: the fake quantizer state (``module.qat``) is set by ``prepare_qat_``. ``isinstance(m,
    qk.FakeQuantizedLinear)`` finds prepared layers.

    Args:
        in_features (int): as ``nn.Linear``.
        out_features (int): as ``nn.Linear``.
        bias (bool): as ``nn.Linear``; default True.
        device (torch.device | None): as ``nn.Linear``; default None.
        dtype (torch.dtype | None): as ``nn.Linear``; default None.

    Example:
        ```python
        import torchqkit as qk
        qk.prepare_qat_(model, qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32)))
        prepared = [n for n, m in model.named_modules() if isinstance(m, qk.FakeQuantizedLinear)]
        ```
    """
    qat: QATState

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.qat
        w = state.weight_quantizer(self.weight)
        spec = state.weight_quantizer.recipe.act_quant
        if spec is not None:
            x = fake_quantize_activation(x, spec, clipped=state.clipped)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        rule = "clipped_ste" if self.qat.clipped else "ste"
        return f"{super().extra_repr()}, fake_quant={self.qat.config.describe()}, grad={rule}"


_CLASSES: dict[type, type] = {nn.Linear: FakeQuantizedLinear}


def fake_quantized_class(cls: type) -> type:
    """The fake-quantized twin of an nn.Linear class whose forward is nn.Linear's (created once per class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FakeQuantized{cls.__name__}", (FakeQuantizedLinear, cls), {"__module__": __name__})
    return _CLASSES[cls]
