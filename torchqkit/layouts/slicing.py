"""Slicing rules shared by every layout: where a slice of a quantized weight may start and end.

Tensor-parallel and vLLM-style loaders narrow weights along out_features or in_features. A slice must
cut whole blocks: along a dim with several blocks, start and end are multiples of the block size;
along a dim with a single block (per-tensor, or per-row along K) any range is fine and the block
shrinks with it. A layout that stores tiles or packed bytes narrows this with ``Layout.slice_multiple``
(e.g. whole 8-row tiles), so that every allowed slice is a view of its storage. A slice that ends at the
dim's end keeps the storage padding of a partial last block (Note [Partial blocks], core/primitives.py).
"""
from __future__ import annotations

import math
from typing import NamedTuple


from ..core.primitives import num_blocks, padded_shape
from .op_table import fill_defaults
from .aliasing import return_view

__all__ = ["BlockSlice", "block_slice", "cut_multiple", "slice_quantized"]


class BlockSlice(NamedTuple):
    dim: int                       # dim of the stored (untransposed) tensor
    codes: tuple[int, int]         # (start, length) in elements along `dim`
    stored: tuple[int, int]        # (start, length) in stored (block-padded) elements along `dim`
    blocks: tuple[int, int]        # (start, length) in scale rows/cols along `dim`
    logical_shape: tuple[int, ...]
    block_size: tuple[int, ...]


def block_slice(aqt, dim: int, start, end, step) -> BlockSlice:
    if step != 1:
        raise ValueError(f"slicing a quantized weight needs step 1, got {step}")
    dim = dim % aqt.dim()
    sdim = (aqt.dim() - 1 - dim) if aqt.transposed else dim
    size = aqt.logical_shape[sdim]
    start = 0 if start is None else max(0, min(size, start + size if start < 0 else start))
    end = size if end is None else max(start, min(size, end + size if end < 0 else end))
    b = aqt.block_size[sdim]
    m = cut_multiple(aqt, sdim)
    if start % m or (end % m and end != size):
        what = f"a block of {b} elements" if m == b else f"a block ({b}) or a storage tile of {aqt.qlayout!r}"
        raise ValueError(f"slice [{start}:{end}] along dim {dim} of a quantized weight of shape {tuple(aqt.shape)} "
                         f"cuts {what}: start and end must be multiples of {m} (or end at {size})")
    shape, block = list(aqt.logical_shape), list(aqt.block_size)
    shape[sdim] = end - start
    if b == size:  # one block along this dim: any allowed range keeps the single scale
        block[sdim] = end - start
        return BlockSlice(sdim, (start, end - start), (start, end - start), (0, 1), tuple(shape), tuple(block))
    stored_end = padded_shape((size,), (b,))[0] if end == size else end
    return BlockSlice(sdim, (start, end - start), (start, stored_end - start),
                      (start // b, num_blocks((end - start,), (b,))[0]), tuple(shape), tuple(block))


def cut_multiple(aqt, sdim: int) -> int:
    """Where a slice along ``sdim`` (of the stored, untransposed shape) may start and end: multiples of this
    (an end at the dim's size is always allowed). Tensor-parallel sharding checks its cuts against it."""
    b, size = aqt.block_size[sdim], aqt.logical_shape[sdim]
    m = aqt.qlayout.slice_multiple(aqt.weight_format, sdim)
    return math.lcm(m, b) if b != size else m  # several blocks along this dim: never cut one


def slice_quantized(func, args, kwargs):
    """``aten.slice.Tensor`` for every layout: ``block_slice`` checks the cut, the layout's ``narrow`` hook cuts its
    inner tensors (views of the storage wherever the layout allows)."""
    self, dim, start, end, step = fill_defaults(args, 5, [0, None, None, 1])
    cut = block_slice(self, dim, start, end, step)
    tensors, layout = self.qlayout.narrow(self, cut)
    return return_view(func, args, kwargs, lambda: self.with_changes(
        tensors, logical_shape=cut.logical_shape, block_size=cut.block_size, qlayout=layout))
