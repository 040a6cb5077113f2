"""FakeQuantizedExperts: a transformers experts module whose forward reads its expert stacks fake-quantized, each
expert as its quantized stack will store it, with straight-through gradients.

Note [Fake-quantized experts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A mixture-of-experts layer keeps its experts as 3-d Parameters of one module (Note [Expert Parameters in
quantize_]), and each transformers experts implementation reads them its own way: "eager" indexes ``w[e]`` once
per routed expert, "grouped_mm" hands the whole stack to ``torch._grouped_mm``, "batched_mm" gathers ``w[ids]``.
So the weight is what gets replaced, not a matmul: ``prepare_qat_`` changes the experts module's class in place
(as it does a Linear's: identity, hooks, Parameters and state-dict keys stay) to a subclass with one property per
trained stack. The subclass's forward fake-quantizes each trained stack once, then runs the module's own forward,
whose reads of ``self.gate_up_proj`` get the fake stack; outside the forward the property gives the float
Parameter, so optimizers, state dicts and ``convert_qat_`` see the float weight.

A fake stack is each expert's (N, K) weight fake-quantized on its own, with the recipe ``quantize_`` stores the
stack with (``quantize_experts``: the config's handler per expert). A recipe whose qparams are blockwise
(``WeightRecipe.blockwise``: round-to-nearest ranges from min / max) does it in one call on the whole stack with
block size (1, bn, bk), the stack's own; one with statistics over a whole weight (HQQ's stopping rule, NVFP4's
global scale, NF4's double quantization) runs expert by expert, because one call would share them across experts.
A module storing its stacks transposed (``is_transposed``) is fake-quantized through the same (E, N, K) view
quantize_ uses (``experts_nk``). So ``convert_qat_`` stores stacks that dequantize to the last forward's fake
stacks bit for bit. The gradient passes straight through (or clipped, Note [Clipped STE]) to the float stack.

Configs that quantize activations are not trained on experts: the inputs of the experts' matmuls are made inside
the experts' forward (the gated product feeding ``down_proj``), where no weight property reaches them;
``prepare_qat_`` reports those stacks as skipped with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..api.configs.base import QuantConfig
from ..api.expert_weights import experts_nk
from .fake_quantize import WeightFakeQuantizer

__all__ = ["FakeQuantizedExperts", "ExpertsQATState", "ExpertWeightQAT", "fake_quantized_experts_class"]


@dataclass
class ExpertWeightQAT:
    config: QuantConfig              # what convert_qat_ quantizes this stack with
    quantizer: WeightFakeQuantizer   # fake-quantizes it as (E, N, K)


@dataclass
class ExpertsQATState:
    original_class: type                        # the module's class before prepare_qat_
    weights: dict[str, ExpertWeightQAT]         # attribute -> how that stack trains
    clipped: bool
    fakes: dict[str, torch.Tensor] | None = None  # this forward's fake stacks; None outside the forward

    def fake(self, module: nn.Module, attr: str) -> torch.Tensor:
        """The fake-quantized stack ``attr`` as the module stores it, with the straight-through gradient."""
        quantizer = self.weights[attr].quantizer
        return experts_nk(module, quantizer(experts_nk(module, module._parameters[attr])))

    def values(self, module: nn.Module, attr: str) -> torch.Tensor:
        """The fake-quantized stack ``attr`` as the module stores it, without autograd."""
        quantizer = self.weights[attr].quantizer
        return experts_nk(module, quantizer.values(experts_nk(module, module._parameters[attr]))[0])


class FakeQuantizedExperts(nn.Module):
    """A transformers experts module (``Qwen3MoeExperts``, ``MixtralExperts``, ...) whose forward reads its 3-d
    expert stacks fake-quantized, each expert as its quantized stack will store it, with straight-through
    gradients.

    ``prepare_qat_`` turns an experts module into one by changing its class in place (to a subclass of the
    module's own class), so the module keeps its identity, hooks, Parameters and state-dict keys, and every
    experts implementation ("eager", "grouped_mm", "batched_mm"; ``config._experts_implementation``) trains
    through it. Inside the forward ``module.gate_up_proj`` is the fake-quantized stack (computed once per
    forward); outside it, the float Parameter. ``convert_qat_`` quantizes the stacks and changes the class back.
    Not built directly: the fake quantizer state (``module.qat``) is set by ``prepare_qat_``. ``isinstance(m,
    qk.FakeQuantizedExperts)`` finds prepared experts modules. See Note [Fake-quantized experts].

    Example:
        ```python
        import torchqkit as qk
        qk.prepare_qat_(moe_model, qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32)))
        prepared = [n for n, m in moe_model.named_modules() if isinstance(m, qk.FakeQuantizedExperts)]
        ```
    """
    qat: ExpertsQATState

    def forward(self, *args, **kwargs):
        state = self.qat
        state.fakes = {attr: state.fake(self, attr) for attr in state.weights}
        try:
            return super().forward(*args, **kwargs)
        finally:
            state.fakes = None

    def extra_repr(self) -> str:
        own = super().extra_repr()
        rule = "clipped_ste" if self.qat.clipped else "ste"
        trained = ", ".join(f"{attr}={w.config.describe()}" for attr, w in self.qat.weights.items())
        return f"{own + ', ' if own else ''}fake_quant: {trained}, grad={rule}"


def _stack_property(attr: str) -> property:
    def read(self):
        fakes = self.qat.fakes
        return self._parameters[attr] if fakes is None else fakes[attr]
    return property(read, doc=f"{attr}: fake-quantized inside the forward, the float Parameter outside it")


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def fake_quantized_experts_class(cls: type, attrs) -> type:
    """The fake-quantized twin of the experts class ``cls`` training the stacks ``attrs`` (created once per pair);
    its name keeps the "Experts" ending that finds experts modules."""
    key = (cls, tuple(sorted(attrs)))
    if key not in _CLASSES:
        body = {attr: _stack_property(attr) for attr in key[1]}
        _CLASSES[key] = type(f"FakeQuantized{cls.__name__}", (FakeQuantizedExperts, cls),
                             {"__module__": __name__, **body})
    return _CLASSES[key]
