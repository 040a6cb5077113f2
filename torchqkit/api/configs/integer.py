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
    """int8 weight-only quantization: symmetric int8 weights, activations stay in float.

    Each selected Linear's weight is stored as int8 codes with one symmetric scale per output channel
    (``group_size=None``) or per group of ``group_size`` consecutive input features. The matmul dequantizes (or
    uses an int8 kernel where the layout has one); activations are not quantized. A safe first choice: about half
    the bytes of bfloat16 weights with little accuracy loss.

    Args:
        group_size (int | None): input features per scale; None (default): one scale per output channel (per row).
            An int must be >= 1.
        layout (Layout): how the codes are stored; default ``PlainLayout()``. A layout name such as ``"plain"`` is
            accepted and converted.
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``. Also accepts its value (``"auto"``, ``"reference"``, ``"triton"``, ``"cuda"``).

    Raises:
        TypeError: a field of the wrong type (e.g. ``group_size=True`` or ``"32"``).
        ValueError: a size below 1, or an unknown layout name.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_(model, qk.Int8WeightOnlyConfig())
        qk.quantize_(other_model, qk.Int8WeightOnlyConfig(group_size=64))
        ```
    """
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
    """int4 group-wise weight-only quantization (uint4 codes, float scale and zero point per group).

    Each group of ``group_size`` consecutive input features of a row gets an asymmetric scale and a zero point in
    the float domain (the tinygemm / tensor-core-tiled convention). The codes are stored by default in
    ``TensorCoreTiledLayout``; pass ``layout=PlainLayout()`` for one unpacked code per byte. Activations stay in
    float. Use it for 4-bit weights served by the tiled int4 kernel; wrap it in ``GPTQConfig`` or ``AWQConfig``
    to choose the codes from calibration data.

    Args:
        group_size (int): input features per scale and zero point; one of 32, 64, 128, 256. Default 128.
        layout (Layout): how the codes are stored; default ``TensorCoreTiledLayout()``. A layout name
            (``"tensor_core_tiled"``, ``"plain"``, ...) is accepted and converted.
        algorithm (str): how scale and zero point are chosen: ``"rtn"`` (default; min-max scale and zero point,
            round to nearest) or ``"hqq"`` (the same scale, zero points optimised by HQQ; no calibration data).
        scale_dtype (str | torch.dtype | None): dtype of the stored scales and zero points: None (default; the
            weight's own dtype), or ``torch.float32`` / ``torch.bfloat16`` / ``torch.float16`` or their names
            (stored as the name). A 16-bit dtype on a float32 model stores 5 bits per weight at group size 32 instead
            of 6; float16 keeps more precision, and a weight whose scales or zero points would pass float16's 65504
            is refused (the layer stays float and the report says why).
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value (``"auto"``, ``"reference"``, ...) is accepted.

    Raises:
        ValueError: ``group_size`` not in (32, 64, 128, 256), an unknown ``algorithm``, or a ``scale_dtype`` that is
            not one of the three.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torch
        import torchqkit as qk
        report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128))
        config = qk.Int4WeightOnlyConfig(group_size=32, algorithm="hqq", scale_dtype=torch.bfloat16)
        ```
    """
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
    """1- to 8-bit signed integer weight-only quantization, per group or per output channel.

    Weights are quantized to ``bits``-bit signed codes with one scale (and, when asymmetric, a zero point) per
    group of input features or per output channel; activations stay in float. By default the codes are packed
    densely (``PackedIntxLayout``) below 8 bits and stored one per byte (``PlainLayout``) at 8 bits. Use it for
    bit widths other than 4 and 8, or for symmetric 4-bit weights.

    Args:
        bits (int): code width, 1..8. Default 4.
        granularity (Granularity): ``PerGroup(n)`` (default ``PerGroup(32)``), ``PerAxis(0)`` or ``PerRow()``
            (one scale per output channel).
        mapping (MappingType): ``MappingType.SYMMETRIC`` (default), ``ASYMMETRIC`` or ``SYMMETRIC_NO_CLIPPING_ERR``,
            or their values (``"symmetric"``, ...). With ``algorithm="hqq"`` it becomes ``ASYMMETRIC``.
        layout (Layout | None): how the codes are stored; None (default): ``PackedIntxLayout()`` for bits < 8,
            ``PlainLayout()`` for 8 bits (see ``resolved_layout()``). A layout name is accepted.
        algorithm (str): ``"rtn"`` (default; round to nearest on absmax / min-max ranges) or ``"hqq"`` (min-max
            scale, float zero point optimised by HQQ, no calibration data; refused with
            ``mapping="symmetric_no_clipping_err"``).
        kernel_preference (KernelPreference): which implementation serves the quantized matmul; default
            ``KernelPreference.AUTO``; its value is accepted.

    Raises:
        ValueError: ``bits`` outside 1..8, a granularity other than the three above (or ``PerAxis`` on another
            axis), an unknown mapping or algorithm, or ``algorithm="hqq"`` with ``SYMMETRIC_NO_CLIPPING_ERR``.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(32)))
        config = qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerRow(), mapping="asymmetric")
        ```
    """
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
