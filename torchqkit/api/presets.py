"""Named configs: one name per config for the CLI (`quantize --config`, `eval --config`) and the demo, so a
figure and the command that reproduces it use the same name.

Each preset is built on request (a fresh config object per call), so listing names constructs nothing. Most
presets are one QuantConfig for every Linear; the "-out8" / "gguf-" ones are a body config plus an output-layer
config: a ModuleConfigs that names ``lm_head`` exactly, so a tied lm_head and its input embedding are quantized
together (Note [Shared weights] in quantize.py). See Note [The output layer].

Note [The output layer]
~~~~~~~~~~~~~~~~~~~~~~~
A decoder reads its output layer (vocab x hidden) in full for every generated token, like every Linear, and
small models have large vocabularies: SmolLM2-135M's 49152 x 576 lm_head is 113 MB in float32, more than its
210 int4 g32 Linears together (80 MB with float32 scales). A tied lm_head is left in float unless named (transformers'
quantizers do the same), so a plain int4 config leaves the biggest read of the decode step in float32.
llama.cpp's mixes keep the output layer at 6-8 bits (Q4_K_M: Q6_K output; Q4_0 / Q4_1 files: Q8_0 or Q6_K).
The output presets quantize it to int8 (per row, or per 32 like Q8_0): 4x fewer bytes than float32, and int8's
error on the logits is far below int4's, so quality stays at the int4 body's level.

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
from .configs import (Float8DynamicActivationFloat8WeightConfig, Float8DynamicActivationInt4WeightConfig,
                      Float8WeightOnlyConfig, FP6WeightOnlyConfig, Int4DynamicActivationInt4WeightConfig,
                      Int4WeightOnlyConfig, MXDynamicActivationMXWeightConfig, Int8DynamicActivationInt8WeightConfig,
                      Int8DynamicActivationIntxWeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig,
                      MXFP4WeightOnlyConfig, MXFP8WeightOnlyConfig, NF4WeightOnlyConfig,
                      NVFP4DynamicActivationNVFP4WeightConfig, NVFP4WeightOnlyConfig, QuantConfig,
                      SparsityConfig)
from ..layouts import PackedIntxLayout
from .module_configs import ModuleConfigs

__all__ = ["PRESETS", "get", "names", "OUTPUT_LAYER"]

# The module name the output presets quantize at 8 bits: transformers' causal LMs call their output layer lm_head.
OUTPUT_LAYER = "lm_head"


def _q41_int8_act(act_granularity, act_mapping) -> Int8DynamicActivationIntxWeightConfig:
    return Int8DynamicActivationIntxWeightConfig(
        weight_granularity=PerGroup(32), weight_mapping="asymmetric", weight_zero_point_domain="float",
        weight_scale_dtype="float16", act_granularity=act_granularity, act_mapping=act_mapping)


def _with_output(body: QuantConfig, output: QuantConfig) -> ModuleConfigs:
    # An exact name, not a pattern: only an exactly named lm_head takes its tied embedding along.
    return ModuleConfigs({OUTPUT_LAYER: output, "_default": body})


PRESETS: dict[str, Callable[[], QuantConfig | ModuleConfigs]] = {
    "int8-wo": lambda: Int8WeightOnlyConfig(),
    "int4-wo-g32": lambda: Int4WeightOnlyConfig(group_size=32),
    "int4-wo-g64": lambda: Int4WeightOnlyConfig(group_size=64),
    "int4-wo-g128": lambda: Int4WeightOnlyConfig(group_size=128),
    # int4 g32 body, the output layer (and a tied embedding) int8 per row: Note [The output layer]
    "int4-wo-g32-out8": lambda: _with_output(Int4WeightOnlyConfig(group_size=32), Int8WeightOnlyConfig()),
    # GGUF-like mix: Q4_1-like body (uint4 per 32, float16 scale and zero point: 5 bits per weight) and a
    # Q8_0-like output layer (int8 per 32, one scale each)
    "gguf-q4_1-out-q8_0": lambda: _with_output(Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.float16),
                                               Int8WeightOnlyConfig(group_size=32)),
    "int4-wo-g32-bf16-scales": lambda: Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.bfloat16),
    "intx4-wo-sym-g32": lambda: IntxWeightOnlyConfig(bits=4, granularity=PerGroup(32)),
    # ternary (BitNet b1.58-style {-1, 0, 1} codes, absmax scale per 32) in bit planes: Note [Ternary bit planes]
    "ternary-g32": lambda: IntxWeightOnlyConfig(bits=2, granularity=PerGroup(32),
                                                mapping="symmetric_no_clipping_err",
                                                layout=PackedIntxLayout(ternary=True)),
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
    # AMD MI300's float8 (e4m3fnuz: max 240, Note [float8 fnuz] in core/qdtype.py), weight-only and x fnuz activations
    "fp8-wo-fnuz": lambda: Float8WeightOnlyConfig(weight_dtype="float8_e4m3fnuz"),
    "fp8-dyn-row-fnuz": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(),
                                                                          activation_dtype="float8_e4m3fnuz",
                                                                          weight_dtype="float8_e4m3fnuz"),
    # 4-bit activations: on an LLM after qk.rotate_ (QuaRot); int4 codes through the int8 x int4 kernel, float8 / MXFP8
    # activations through the weight-only kernels (fake-quantized)
    "int4-dyn-int4-g32": lambda: Int4DynamicActivationInt4WeightConfig(group_size=32),
    "fp8-dyn-int4-g32": lambda: Float8DynamicActivationInt4WeightConfig(group_size=32),
    "mxfp8-dyn-mxfp4": lambda: MXDynamicActivationMXWeightConfig(weight="mxfp4"),
    "mxfp8-dyn-mxfp8": lambda: MXDynamicActivationMXWeightConfig(weight="mxfp8"),
    # 2:4 magnitude pruning, float values kept (no calibration data; Wanda / SparseGPT need it)
    "sparse-2of4": lambda: SparsityConfig(pattern=(2, 4)),
    # 2:4 magnitude pruning, kept values as int8 per row / int4 g32 codes (torchqkit::linear_nm_sparse_wo)
    "sparse-2of4-int8": lambda: SparsityConfig(pattern=(2, 4), base=Int8WeightOnlyConfig()),
    "sparse-2of4-int4-g32": lambda: SparsityConfig(pattern=(2, 4), base=Int4WeightOnlyConfig(group_size=32)),
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
            print(name, qk.presets.get(name).describe())   # ModuleConfigs describe themselves too
        ```
    """
    return tuple(PRESETS)


def get(name: str) -> QuantConfig | ModuleConfigs:
    """A fresh config for the preset ``name``.

    Each call builds a new config object, so callers may keep or compare it freely. Presets with an output layer
    (``"int4-wo-g32-out8"``, ``"gguf-q4_1-out-q8_0"``) are a ``ModuleConfigs``: the body config as ``"_default"``
    and an 8-bit config for ``"lm_head"`` (a tied input embedding follows it).

    Args:
        name (str): a preset name, one of ``names()`` (e.g. ``"int4-wo-g128"``, ``"int8-dyn-int8"``, ``"nf4-b64"``).

    Returns:
        QuantConfig | ModuleConfigs: the preset's config, e.g. ``Int4WeightOnlyConfig(group_size=128)`` for
        ``"int4-wo-g128"``, or ``ModuleConfigs({"lm_head": Int8WeightOnlyConfig(), "_default":
        Int4WeightOnlyConfig(group_size=32)})`` for ``"int4-wo-g32-out8"``.

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
