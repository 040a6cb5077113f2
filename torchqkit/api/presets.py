"""Named configs: one name per config for the CLI (`quantize --config`, `eval --config`) and the demo, so a
figure and the command that reproduces it use the same name.

Each preset is built on request (a fresh config object per call), so listing names constructs nothing.

Example:
    ```python
    import torchqkit as qk
    qk.presets.names()               # ('int8-wo', 'int4-wo-g32', ...)
    qk.presets.get("int4-wo-g128")   # Int4WeightOnlyConfig(group_size=128)
    ```
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..core import PerGroup, PerRow, PerToken
from .configs import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, FP6WeightOnlyConfig,
                      Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                      Int8DynamicActivationIntxWeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig,
                      MXFP4WeightOnlyConfig, MXFP8WeightOnlyConfig, NF4WeightOnlyConfig,
                      NVFP4DynamicActivationNVFP4WeightConfig, NVFP4WeightOnlyConfig, QuantConfig)

__all__ = ["PRESETS", "get", "names"]


def _q41_int8_act(act_granularity, act_mapping) -> Int8DynamicActivationIntxWeightConfig:
    return Int8DynamicActivationIntxWeightConfig(
        weight_granularity=PerGroup(32), weight_mapping="asymmetric", weight_zero_point_domain="float",
        weight_scale_dtype="float16", act_granularity=act_granularity, act_mapping=act_mapping)


PRESETS: dict[str, Callable[[], QuantConfig]] = {
    "int8-wo": lambda: Int8WeightOnlyConfig(),
    "int4-wo-g32": lambda: Int4WeightOnlyConfig(group_size=32),
    "int4-wo-g64": lambda: Int4WeightOnlyConfig(group_size=64),
    "int4-wo-g128": lambda: Int4WeightOnlyConfig(group_size=128),
    "int4-wo-g32-bf16-scales": lambda: Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.bfloat16),
    "intx4-wo-sym-g32": lambda: IntxWeightOnlyConfig(bits=4, granularity=PerGroup(32)),
    "int8-dyn-int8": lambda: Int8DynamicActivationInt8WeightConfig(),
    "int8-dyn-int4-g32": lambda: Int8DynamicActivationIntxWeightConfig(weight_bits=4, weight_granularity=PerGroup(32)),
    # GGUF Q4_1's weights (float16 scale and float minimum per 32) x int8 activations per token, or per token and
    # group of 32 (llama.cpp's Q8_1): Note [int8 x int4 float zero points] in csrc/cpu/linear_int8da_int4_packed.cpp
    "int8-dyn-int4-q41": lambda: _q41_int8_act(PerToken(), "asymmetric"),
    "int8-dyn-g32-int4-q41": lambda: _q41_int8_act(PerGroup(32), "symmetric"),
    "nf4-b64": lambda: NF4WeightOnlyConfig(block_size=64),
    "nf4-b64-dq": lambda: NF4WeightOnlyConfig(block_size=64, double_quant=True),
    "mxfp4": lambda: MXFP4WeightOnlyConfig(),
    "nvfp4": lambda: NVFP4WeightOnlyConfig(),
    "nvfp4-dyn-nvfp4": lambda: NVFP4DynamicActivationNVFP4WeightConfig(),
    "fp6-e3m2": lambda: FP6WeightOnlyConfig(ebits=3),
    "fp6-e2m3": lambda: FP6WeightOnlyConfig(ebits=2),
    "mxfp8": lambda: MXFP8WeightOnlyConfig(),
    "fp8-wo": lambda: Float8WeightOnlyConfig(),
    "fp8-dyn-row": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
}


def names() -> tuple[str, ...]:
    """The names of every preset, in a fixed order.

    Listing names constructs no config. These are the names the CLI's ``--config`` and the demo accept.

    Returns:
        tuple[str, ...]: the preset names, e.g. ``("int8-wo", "int4-wo-g32", ...)``.

    Example:
        ```python
        import torchqkit as qk
        for name in qk.presets.names():
            print(name, qk.presets.get(name).describe())
        ```
    """
    return tuple(PRESETS)


def get(name: str) -> QuantConfig:
    """A fresh config for the preset ``name``.

    Each call builds a new config object, so callers may keep or compare it freely.

    Args:
        name (str): a preset name, one of ``names()`` (e.g. ``"int4-wo-g128"``, ``"int8-dyn-int8"``, ``"nf4-b64"``).

    Returns:
        QuantConfig: the preset's config, e.g. ``Int4WeightOnlyConfig(group_size=128)`` for ``"int4-wo-g128"``.

    Raises:
        ValueError: an unknown name (the message lists the presets).

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.presets.get("int4-wo-g128"))
        ```
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]()
