"""Config names: every config a benchmark measures is a torchqkit preset (torchqkit.presets), or a preset with
explicit changes, `<preset>+<change>[+<change>...]`, each change a named edit of the preset's config applied left to
right (e.g. `intx4-wo-sym-g32+bits3`, `int4-wo-g128+gptq`, `int8-dyn-int8+static+mse`). So a figure and the command
that reproduces it, in benchmarks and in the CLI, name the same config. `float32` / `bfloat16` are the unquantized
baselines, not configs."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

import torchqkit as qk
from torchqkit.core import PerGroup
from torchqkit.core import qdtypes as Q

BASELINES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _replace(**fields) -> Callable:
    return lambda c: dataclasses.replace(c, **fields)


def _group(c, g: int):
    if isinstance(c, (qk.Int4WeightOnlyConfig, qk.Int8WeightOnlyConfig)):
        return dataclasses.replace(c, group_size=g)
    if isinstance(c, qk.IntxWeightOnlyConfig):
        return dataclasses.replace(c, granularity=PerGroup(g))
    if isinstance(c, qk.Int8DynamicActivationIntxWeightConfig):
        return dataclasses.replace(c, weight_granularity=PerGroup(g))
    if isinstance(c, qk.NF4WeightOnlyConfig):
        return dataclasses.replace(c, block_size=g)
    if isinstance(c, qk.FP6WeightOnlyConfig):
        return dataclasses.replace(c, group_size=g)
    raise ValueError(f"+g{g}: {type(c).__name__} has no group size")


def _per_channel(c):
    if isinstance(c, qk.IntxWeightOnlyConfig):
        return dataclasses.replace(c, granularity=qk.PerRow())
    if isinstance(c, qk.Int8DynamicActivationIntxWeightConfig):
        return dataclasses.replace(c, weight_granularity=qk.PerRow())
    raise ValueError(f"+per-channel: {type(c).__name__} has no weight granularity to change")


def _bits(c, bits: int):
    if isinstance(c, qk.IntxWeightOnlyConfig):
        return dataclasses.replace(c, bits=bits)
    if isinstance(c, qk.Int8DynamicActivationIntxWeightConfig):
        return dataclasses.replace(c, weight_bits=bits)
    raise ValueError(f"+bits{bits}: {type(c).__name__} has no bit width")


def _static(c):
    if not isinstance(c, qk.Int8DynamicActivationInt8WeightConfig):
        raise ValueError(f"+static: int8 x int8 presets only, not {type(c).__name__}")
    return qk.Int8StaticActivationInt8WeightConfig()


def _on_static(**fields) -> Callable:
    def change(c):
        if not isinstance(c, qk.Int8StaticActivationInt8WeightConfig):
            raise ValueError(f"+{'/'.join(fields)}: needs +static before it")
        return dataclasses.replace(c, **fields)
    return change


def _sparse(c):
    if isinstance(c, qk.SparsityConfig):
        raise ValueError("+2of4: the config is already a SparsityConfig")
    return qk.SparsityConfig(pattern=(2, 4), base=c)


def _pruning(method: str) -> Callable:
    def change(c):
        if not isinstance(c, qk.SparsityConfig):
            raise ValueError(f"+{method}: a SparsityConfig only (a sparse-* preset, or +2of4 before it)")
        return dataclasses.replace(c, method=method)
    return change


# change name -> (what it does, config -> config)
CHANGES: dict[str, tuple[str, Callable]] = {
    "hqq": ("zero points optimised by HQQ", _replace(algorithm="hqq")),
    "fp16-scales": ("float16 scales and zero points", _replace(scale_dtype="float16")),
    "per-channel": ("one weight scale per output channel (PerRow) instead of per group", _per_channel),
    "bf16-scales": ("bfloat16 scales and zero points", _replace(scale_dtype="bfloat16")),
    "tiles8": ("TensorCoreTiledLayout(inner_k_tiles=8) for every weight",
               _replace(layout=qk.TensorCoreTiledLayout(inner_k_tiles=8))),
    "e5m2": ("float8 e5m2 codes", _replace(weight_dtype=Q.float8_e5m2)),
    "gptq": ("GPTQ on calibration data", lambda c: qk.GPTQConfig(c)),
    "gptq-act-order": ("GPTQ, columns by decreasing Hessian diagonal", lambda c: qk.GPTQConfig(c, act_order=True)),
    "gptq-true-sequential": ("GPTQ, each Linear's Hessian from the quantized ones before it",
                             lambda c: qk.GPTQConfig(c, true_sequential=True)),
    "awq": ("AWQ activation-aware scaling", lambda c: qk.AWQConfig(c)),
    "smoothquant": ("SmoothQuant, alpha 0.5", lambda c: qk.SmoothQuantConfig(c, alpha=0.5)),
    "static": ("static int8 activation scales from calibration (SmoothQuant 0.8, min/max)", _static),
    "mse": ("static scales by the MSE observer", _on_static(observer="mse")),
    "percentile": ("static scales by the percentile observer", _on_static(observer="percentile")),
    "no-smoothing": ("static scales without SmoothQuant", _on_static(smoothing=None)),
    "2of4": ("2:4 magnitude pruning, the kept values quantized by the config", _sparse),
    "wanda": ("pruning by Wanda's |w| * ||x|| on calibration data", _pruning("wanda")),
    "sparsegpt": ("pruning (and quantizing) by SparseGPT on calibration data", _pruning("sparsegpt")),
    "smoothing0.5": ("static scales after SmoothQuant 0.5", _on_static(smoothing=0.5)),
}
PATTERNS = {r"g(\d+)": ("group (block) size N", _group), r"bits(\d+)": ("N-bit codes", _bits)}


def describe_changes() -> str:
    return ", ".join([*CHANGES, "gN", "bitsN"])


def _change(name: str) -> Callable:
    if name in CHANGES:
        return CHANGES[name][1]
    for pattern, (_, fn) in PATTERNS.items():
        m = re.fullmatch(pattern, name)
        if m:
            return lambda c, n=int(m.group(1)): fn(c, n)
    raise ValueError(f"unknown change +{name}; changes: {describe_changes()}")


def build(name: str):
    """The config named `name` (None for a float baseline); ValueError naming the presets or changes otherwise."""
    if name in BASELINES:
        return None
    preset, *changes = name.split("+")
    if preset not in qk.presets.names():
        raise ValueError(f"unknown config {name!r}: {preset!r} is not a preset; presets: "
                         f"{', '.join(qk.presets.names())}"
                         f" (baselines: {', '.join(BASELINES)}; changes after '+': {describe_changes()})")
    config = qk.presets.get(preset)
    if changes and isinstance(config, qk.ModuleConfigs):
        raise ValueError(f"{name!r}: changes after '+' edit one config, and {preset!r} is a body config plus an "
                         f"output-layer config (a ModuleConfigs); write a ModuleConfigs JSON instead")
    for change in changes:
        config = _change(change)(config)
    return config


def check(names: list[str]) -> list[str]:
    """`names`, each checked by building it (errors are raised before any measurement starts)."""
    for name in names:
        build(name)
    return names


def split_names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]
