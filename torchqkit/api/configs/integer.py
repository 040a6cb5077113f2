"""Weight-only integer configs: Int8WeightOnlyConfig, Int4WeightOnlyConfig, IntxWeightOnlyConfig."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ...algorithms import check_algorithm
from ...core.granularity import Granularity, PerAxis, PerGroup, PerRow
from ...core.primitives import MappingType, ZeroPointDomain
from ...core.qdtype import INT, uint4, int8
from ...layouts.base import Layout
from ...layouts.packed_intx import PackedIntxLayout
from ...layouts.plain import PlainLayout
from ...layouts.tensor_core_tiled import TensorCoreTiledLayout
from ..quantize_weight import WeightRecipe
from .base import QuantConfig, register_recipe_config

__all__ = ["Int8WeightOnlyConfig", "Int4WeightOnlyConfig", "IntxWeightOnlyConfig"]

INT4_GROUP_SIZES = (32, 64, 128, 256)
# Note [int4 scale dtype]: scale and zero point are stored in the weight's dtype unless the config names one. A
# float32 model's g32 weights then carry 8 bytes of (scale, zero) per 32 codes, 6 bits per weight in all: 20% more
# than llama.cpp's Q4_1 (fp16 scale and min per 32, 5 bits), and a decode step reads every byte of it. bfloat16 /
# float16 scales make it 5 bits (torch's own int4 kernels and torchao keep them in bfloat16).
INT4_SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _int8_weight_only_recipe(config):
    granularity = PerRow() if config.group_size is None else PerGroup(config.group_size)
    return WeightRecipe(int8, granularity, config.layout, mapping=MappingType.SYMMETRIC,
                        kernel_preference=config.kernel_preference)


@register_recipe_config(_int8_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class Int8WeightOnlyConfig(QuantConfig):
    """int8 symmetric weights, one scale per output channel (group_size=None) or per group of K."""
    group_size: int | None = None
    layout: Layout = field(default_factory=PlainLayout)

    def describe(self):
        return f"int8 weight-only {'per-channel' if self.group_size is None else f'g{self.group_size}'}"


def _int4_weight_only_recipe(config):
    # uint4 codes, scale and zero point in the float domain (tinygemm / tensor-core-tiled convention).
    return WeightRecipe(uint4, PerGroup(config.group_size), config.layout, mapping=MappingType.ASYMMETRIC,
                        zero_point_domain=ZeroPointDomain.FLOAT, kernel_preference=config.kernel_preference,
                        algorithm=config.algorithm, scale_dtype=INT4_SCALE_DTYPES.get(config.scale_dtype))


@register_recipe_config(_int4_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class Int4WeightOnlyConfig(QuantConfig):
    """int4 group-wise weights (uint4 codes, float scale and zero point per group), stored by default in
    TensorCoreTiledLayout (pass layout=PlainLayout() for one unpacked code per byte).

    algorithm: "rtn" (min-max scale and zero) or "hqq" (the same scale, zero points optimised by HQQ,
    no calibration data; see torchqkit/algorithms/hqq.py).
    scale_dtype: dtype of the stored scales and zero points: None (the weight's own), or torch.float32 /
    torch.bfloat16 / torch.float16 (or its name). A 16-bit dtype on a float32 model stores 5 bits per weight
    at g32 instead of 6 (Note [int4 scale dtype]); float16 keeps more precision, and a weight whose scales or
    zeros would pass its 65504 is refused (the layer stays float, the report says why)."""
    group_size: int = 128
    layout: Layout = field(default_factory=TensorCoreTiledLayout)
    algorithm: str = "rtn"
    scale_dtype: Literal["float32", "bfloat16", "float16"] | None = None

    def __post_init__(self):
        if isinstance(self.scale_dtype, torch.dtype):  # stored by name: configs are JSON-encodable
            name = next((k for k, v in INT4_SCALE_DTYPES.items() if v == self.scale_dtype), None)
            if name is None:
                raise ValueError(f"Int4WeightOnlyConfig: scale_dtype must be one of torch.float32, torch.bfloat16, "
                                 f"torch.float16 (or None: the weight's dtype), got {self.scale_dtype}")
            object.__setattr__(self, "scale_dtype", name)
        super().__post_init__()
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"Int4WeightOnlyConfig: group_size must be one of {INT4_GROUP_SIZES}, "
                             f"got {self.group_size}")
        check_algorithm("Int4WeightOnlyConfig", self.algorithm)

    def describe(self):
        scales = f", {self.scale_dtype} scales" if self.scale_dtype else ""
        return f"int4 weight-only g{self.group_size}{_algorithm_text(self.algorithm)}{scales}"


def _intx_weight_only_recipe(config):
    # HQQ's zero point is a float (x ~ q * s + z for signed codes): every intx layout but ternary planes
    # stores one, and rounding it to an integer code undoes HQQ's gain (measured: back to RTN's SQNR).
    zpd = ZeroPointDomain.FLOAT if config.algorithm == "hqq" else None
    return WeightRecipe(INT[config.bits], config.granularity, config.resolved_layout(), mapping=config.mapping,
                        zero_point_domain=zpd, kernel_preference=config.kernel_preference, algorithm=config.algorithm)


def check_intx(who: str, bits: int, granularity, mapping) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"{who}: bits must be an int in 1..8, got {bits!r}")
    if not isinstance(granularity, (PerGroup, PerAxis, PerRow)):
        raise ValueError(f"{who}: granularity must be PerGroup(n), PerAxis(0) or PerRow(), got {granularity!r}")
    if isinstance(granularity, PerAxis) and granularity.axis not in (0, -2):
        raise ValueError(f"{who}: PerAxis({granularity.axis}) would share scales across output channels; use PerAxis(0)")
    MappingType(mapping)


@register_recipe_config(_intx_weight_only_recipe)
@dataclass(frozen=True, kw_only=True)
class IntxWeightOnlyConfig(QuantConfig):
    """1..8-bit signed integer weights, per group or per output channel, symmetric or asymmetric.

    layout=None (default): PackedIntxLayout (dense bits) for bits < 8, PlainLayout for 8 bits.
    algorithm: "rtn" (round-to-nearest on absmax / min-max ranges) or "hqq" (min-max scale, zero point in
    the float domain optimised by HQQ, no calibration data; see torchqkit/algorithms/hqq.py). HQQ is
    asymmetric by construction: with it the mapping becomes ASYMMETRIC (SYMMETRIC_NO_CLIPPING_ERR is refused)."""
    bits: int = 4
    granularity: Granularity = PerGroup(32)
    mapping: MappingType = MappingType.SYMMETRIC
    layout: Layout | None = None
    algorithm: str = "rtn"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "mapping", MappingType(self.mapping))
        check_intx("IntxWeightOnlyConfig", self.bits, self.granularity, self.mapping)
        check_algorithm("IntxWeightOnlyConfig", self.algorithm)
        if self.algorithm == "hqq":
            if self.mapping is MappingType.SYMMETRIC_NO_CLIPPING_ERR:
                raise ValueError("IntxWeightOnlyConfig: algorithm='hqq' optimises an asymmetric zero point; it can't "
                                 "keep mapping='symmetric_no_clipping_err' (use mapping='asymmetric')")
            object.__setattr__(self, "mapping", MappingType.ASYMMETRIC)

    def resolved_layout(self) -> Layout:
        """The layout the weights get: ``layout``, or by default packed bits below 8 bits, plain at 8."""
        if self.layout is not None:
            return self.layout
        return PackedIntxLayout() if self.bits < 8 else PlainLayout()

    def describe(self):
        scheme = "hqq" if self.algorithm == "hqq" else self.mapping.value
        return f"int{self.bits} weight-only {_granularity_text(self.granularity)} {scheme}"


def _granularity_text(g) -> str:
    return f"g{g.group_size}" if isinstance(g, PerGroup) else "per-channel"


def _algorithm_text(algorithm: str) -> str:
    return "" if algorithm == "rtn" else f" {algorithm}"
