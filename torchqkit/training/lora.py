"""LoRA adapters on frozen (quantized or float) Linear layers: the QLoRA recipe in two calls.

    qk.quantize_(model, qk.NF4WeightOnlyConfig())
    qk.add_lora_(model, rank=8)          # every other parameter frozen; each Linear but lm_head gets B A
"""
from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["LoRALinear", "add_lora_"]


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update: y = base(x) + B (A x).

    B starts at zero, so the wrapped model computes exactly what it did until the first optimizer step. The base
    may be quantized (QLoRA: ``NF4WeightOnlyConfig`` weights pass gradients to the input). ``add_lora_`` wraps a
    model's Linears with it; the adapters are ``lora_a`` (in_features -> rank) and ``lora_b`` (rank ->
    out_features), both without bias.

    Args:
        base (torch.nn.Linear): the Linear to wrap (kept as ``self.base``; ``add_lora_`` freezes it).
        rank (int): the rank of the update, >= 1; default 8.

    Raises:
        ValueError: ``base`` is not an ``nn.Linear``, or ``rank`` < 1.

    Example:
        ```python
        import torch
        import torchqkit as qk
        layer = qk.LoRALinear(torch.nn.Linear(64, 32), rank=4)
        y = layer(torch.randn(2, 64))           # equals layer.base(x) until lora_b is trained
        ```
    """

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
    """Add LoRA adapters to a (quantized) model for fine-tuning, in place: the QLoRA recipe's second step.

    Freezes every float parameter of ``model`` (quantized weights are frozen already) and replaces each selected
    ``nn.Linear`` by a ``LoRALinear`` around it, in module order, so a seeded generator gives every process the same
    adapters. Only the adapters then train.

    Args:
        model (torch.nn.Module): the model, changed in place.
        rank (int): the adapters' rank, >= 1; default 8.
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` selects the Linears to
            wrap; None (default): every ``nn.Linear`` but ``lm_head``. Keyword-only.

    Returns:
        list[str]: the names of the wrapped modules.

    Raises:
        ValueError: ``rank`` < 1 (from ``LoRALinear``).

    Example:
        ```python
        import torch
        import torchqkit as qk
        qk.quantize_(model, qk.NF4WeightOnlyConfig())
        wrapped = qk.add_lora_(model, rank=8)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ```
    """
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
