"""Small models and file helpers shared by the reliability tests."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

import torchqkit as qk


def mlp(seed: int, config=None) -> nn.Sequential:
    """Two Linears and a LayerNorm, quantized with ``config`` (int8 weight-only by default)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 32)).eval()
    qk.quantize_(model, config or qk.Int8WeightOnlyConfig(), strict=True)
    return model


def meta_mlp() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 32)).eval()


X = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))


def outputs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(X)


def listing(directory: Path) -> dict[str, bytes]:
    """Every file in ``directory`` (hidden temporaries included) with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def temporaries(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".") or n.endswith((".tmp", ".data")) or ".part" in n]
