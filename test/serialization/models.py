"""A small model whose Linears cover every layout, for the serialization tests and the checked-in file."""
from __future__ import annotations

import torch
from torch import nn

import torchqkit as qk
from torchqkit.core import qdtypes as Q

# module name -> config; one per layout (and the knobs that change the packed shapes).
LAYER_CONFIGS = {
    "int8_row": qk.Int8WeightOnlyConfig(),
    "int8_dyn": qk.Int8DynamicActivationInt8WeightConfig(),
    # inner_k_tiles 8 named: the checked-in file (format 1) was written at that tiling, before the per-weight default
    "int4_tiled": qk.Int4WeightOnlyConfig(group_size=32, layout=qk.TensorCoreTiledLayout(inner_k_tiles=8)),
    "nf4_dq": qk.NF4WeightOnlyConfig(block_size=64, double_quant=True),
    "intx3": qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(32), mapping=qk.MappingType.ASYMMETRIC),
    "fp8_dyn": qk.Float8DynamicActivationFloat8WeightConfig(granularity=qk.PerRow()),
    "mxfp4": qk.MXFP4WeightOnlyConfig(),
    "kept": None,
}


class AllLayouts(nn.Module):
    """One 64 -> 64 Linear per layout (residual tanh chain), an embedding tied to the head, an int buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.blocks = nn.ModuleDict({name: nn.Linear(64, 64, bias=(i % 2 == 0)) for i, name in enumerate(LAYER_CONFIGS)})
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("step", torch.tensor([3], dtype=torch.int64))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks.values():
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x)) * self.step


def module_configs() -> qk.ModuleConfigs:
    return qk.ModuleConfigs({f"blocks.{k}": v for k, v in LAYER_CONFIGS.items()})


def quantized_model(seed: int = 0) -> AllLayouts:
    torch.manual_seed(seed)
    model = AllLayouts().eval()
    qk.quantize_(model, module_configs(), filter_fn=lambda m, fqn: fqn.startswith("blocks."), strict=True)
    return model


def meta_model() -> AllLayouts:
    with torch.device("meta"):
        return AllLayouts().eval()


def model_input() -> torch.Tensor:
    return torch.arange(2 * 5).reshape(2, 5) % 32
