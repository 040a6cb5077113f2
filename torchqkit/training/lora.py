"""LoRA adapters on frozen (quantized or float) Linear layers: the QLoRA recipe in two calls.

    qk.quantize_(model, qk.NF4WeightOnlyConfig())
    qk.add_lora_(model, rank=8)          # every other parameter frozen; each Linear but lm_head gets B A
"""
from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["LoRALinear", "add_lora_"]


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update: y = base(x) + B (A x), B starting at zero, so the
    wrapped model computes exactly what it did until the first optimizer step."""

    def __init__(self, base: nn.Linear, rank: int = 8):
        super().__init__()
        if not isinstance(base, nn.Linear) or rank < 1:
            raise ValueError(f"LoRALinear wraps an nn.Linear with rank >= 1, got {type(base).__name__}, rank={rank}")
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def _not_lm_head(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn.rpartition(".")[2] != "lm_head"


def add_lora_(model: nn.Module, rank: int = 8, *,
              filter_fn: Callable[[nn.Module, str], bool] | None = None) -> list[str]:
    """Freeze every float parameter of ``model`` (quantized weights are frozen already) and replace each selected
    nn.Linear (default: every one but ``lm_head``) by a LoRALinear around it, in module order (so a seeded
    generator gives every process the same adapters). Returns the wrapped modules' names."""
    selected = filter_fn or _not_lm_head
    for p in model.parameters():
        if p.requires_grad:
            p.requires_grad_(False)
    names = [fqn for fqn, m in model.named_modules() if fqn and selected(m, fqn) and isinstance(m, nn.Linear)]
    for fqn in names:
        parent_name, _, attr = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), rank))
    return names
