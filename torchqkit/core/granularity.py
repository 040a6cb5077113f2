"""Granularity objects: each one only produces a ``block_size`` tuple for a given shape.

``block_size[d]`` is how many consecutive elements along dimension ``d`` share one scale, so the
scale tensor has shape ``[ceil(s / b) for s, b in zip(shape, block_size)]``. Blocks may tile any axes
("subchannel" blocks such as 128x128); a block size that doesn't divide its dimension leaves a partial
last block (see Note [Partial blocks] in primitives.py).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Granularity", "PerTensor", "PerAxis", "PerGroup", "PerRow", "PerToken", "PerBlock",
           "validate_block_size"]


class Granularity:
    def block_size(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One scale for the whole tensor.

    A granularity: its ``block_size(shape)`` is the shape itself. Used for per-tensor float8 scales and static
    activation scales.

    Example:
        ```python
        import torchqkit as qk
        assert qk.PerTensor().block_size((64, 256)) == (64, 256)
        config = qk.Float8WeightOnlyConfig(granularity=qk.PerTensor())
        ```
    """

    def block_size(self, shape):
        return tuple(shape)


@dataclass(frozen=True)
class PerAxis(Granularity):
    """One scale per index along ``axis``; every other dimension is one block.

    ``PerAxis(0)`` of an (N, K) weight is one scale per row (output channel), the same blocks as ``PerRow()``.
    The weight configs take only ``PerAxis(0)`` (or ``-2``): other axes would share scales across output channels.

    Args:
        axis (int): the dimension that gets one scale per index; negative values count from the end. Must be an
            int (not a bool or float); checked against the tensor's rank when ``block_size`` is called.

    Raises:
        ValueError: ``axis`` is not an int, or (from ``block_size``) out of range for the tensor.

    Example:
        ```python
        import torchqkit as qk
        assert qk.PerAxis(0).block_size((64, 256)) == (1, 256)
        config = qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerAxis(0))
        ```
    """
    axis: int

    def __post_init__(self):
        if not _is_int(self.axis):
            raise ValueError(f"PerAxis: axis must be an int, got {self.axis!r}")

    def block_size(self, shape):
        axis = _normalize_axis(self.axis, len(shape), self)
        return tuple(1 if d == axis else s for d, s in enumerate(shape))


@dataclass(frozen=True)
class PerRow(Granularity):
    """One scale per row: every dimension but the last has block 1 (a weight's output channels).

    Example:
        ```python
        import torchqkit as qk
        assert qk.PerRow().block_size((64, 256)) == (1, 256)
        config = qk.Float8WeightOnlyConfig(granularity=qk.PerRow())
        ```
    """

    def block_size(self, shape):
        return (1,) * (len(shape) - 1) + (shape[-1],)


@dataclass(frozen=True)
class PerToken(Granularity):
    """One scale per token of an activation (..., K): the same blocks as ``PerRow``, named for activations.

    Example:
        ```python
        import torchqkit as qk
        assert qk.PerToken().block_size((4, 16, 256)) == (1, 1, 256)
        config = qk.Int8DynamicActivationIntxWeightConfig(act_granularity=qk.PerToken())
        ```
    """

    def block_size(self, shape):
        return (1,) * (len(shape) - 1) + (shape[-1],)


@dataclass(frozen=True)
class PerGroup(Granularity):
    """``group_size`` consecutive elements of the last dimension share a scale.

    For an (N, K) weight, each row is cut into groups of ``group_size`` input features. A group size that doesn't
    divide K leaves a partial last group.

    Args:
        group_size (int): elements per group along the last dimension; a positive int (not a bool or float).

    Raises:
        ValueError: ``group_size`` is not a positive int.

    Example:
        ```python
        import torchqkit as qk
        assert qk.PerGroup(32).block_size((64, 256)) == (1, 32)
        config = qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(32))
        ```
    """
    group_size: int

    def __post_init__(self):
        if not _is_int(self.group_size) or self.group_size <= 0:
            raise ValueError(f"PerGroup: group_size must be a positive int, got {self.group_size!r}")

    def block_size(self, shape):
        return (1,) * (len(shape) - 1) + (self.group_size,)


@dataclass(frozen=True)
class PerBlock(Granularity):
    """An explicit block shape, right-aligned with the tensor's shape (missing leading dimensions get 1).

    Used for "subchannel" blocks such as 128x128 float8 weight scales. A block that doesn't
    divide its dimension leaves a partial last block.

    Args:
        block_shape (tuple[int, ...]): block size per trailing dimension: a non-empty tuple (or list, stored as a
            tuple) of positive ints. ``block_size`` refuses a tensor with fewer dimensions.

    Raises:
        ValueError: ``block_shape`` is empty or holds something other than positive ints, or (from ``block_size``)
            has more dimensions than the tensor.

    Example:
        ```python
        import torchqkit as qk
        assert qk.PerBlock((128, 128)).block_size((512, 1024)) == (128, 128)
        config = qk.Float8WeightOnlyConfig(granularity=qk.PerBlock((128, 128)))
        ```
    """
    block_shape: tuple[int, ...]

    def __post_init__(self):
        shape = tuple(self.block_shape) if isinstance(self.block_shape, (tuple, list)) else None
        if not shape or not all(_is_int(b) and b > 0 for b in shape):
            raise ValueError(f"PerBlock: block_shape must be a tuple of positive ints, got {self.block_shape!r}")
        object.__setattr__(self, "block_shape", shape)

    def block_size(self, shape):
        if len(self.block_shape) > len(shape):
            raise ValueError(f"PerBlock{self.block_shape} has more dims than the tensor shape {tuple(shape)}")
        return (1,) * (len(shape) - len(self.block_shape)) + self.block_shape


def _is_int(value) -> bool:
    """A real int: True / False and floats (1.0, 1.5) are not sizes or axes."""
    return isinstance(value, int) and not isinstance(value, bool)


def _normalize_axis(axis: int, ndim: int, who) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{who}: axis {axis} out of range for a {ndim}-d tensor")
    return axis % ndim


def validate_block_size(shape, block_size) -> str | None:
    """Return why ``block_size`` can't tile ``shape``, or None if it can (partial last blocks are fine)."""
    shape, block_size = tuple(shape), tuple(block_size)
    if len(shape) != len(block_size):
        return f"block_size {block_size} has {len(block_size)} dims but the tensor shape {shape} has {len(shape)}"
    for d, (s, b) in enumerate(zip(shape, block_size)):
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            return f"block size {b!r} along dimension {d} must be a positive int"
        if s < 1:
            return f"dimension {d} has size {s}: there is nothing to quantize"
    return None
