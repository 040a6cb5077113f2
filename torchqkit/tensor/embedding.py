"""aten.embedding on an AffineQuantizedTensor: gather rows, dequantizing only the row tiles that hold them.

An nn.Embedding tied to a quantized lm_head (or quantized on purpose) reads the same (vocab, hidden) weight
the Linear does. ``nn.Embedding.forward`` -> ``F.embedding`` -> ``aten.embedding``, which reaches
``__torch_dispatch__`` (``__torch_function__`` passes F.embedding through); the generic op table maps it here.

Note [Quantized embedding]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A row-major layout (``Layout.gather_rows``: one row of codes, scales and zero points per weight row) gives
the unique rows directly, one index_select per inner tensor. Other layouts store rows in tiles (8-row
n-tiles, row blocks of a 2-d block size, NF4's shared second-level scales): ``Layout.slice_multiple``
along the row dim, widened to whole blocks as ``block_slice`` does, is the smallest row range a slice can
cut. Eager:
  1. unique ids, sorted (``inverse`` maps every position back to its unique row);
  2. the tiles holding them, merged into segments: two runs of needed tiles are fetched as one when the
     tiles between them hold at most GAP_ELEMS elements, because one slice + dequantize call costs about
     as much as dequantizing that many elements (0.1-0.3 ms versus 5-25 ns per element on a 2-core EPYC,
     depending on the layout: 10k-50k elements); a segment is cut into chunks of at most CHUNK_ELEMS
     elements, which bounds the float temporaries whatever the ids;
  3. per chunk: the layout's own aliasing ``aten.slice`` (a view of the packed storage), ``dequantize()``,
     ``index_select`` of the needed rows; the rows of all chunks, in id order, form a table of the unique rows;
  4. ``table[inverse]``.
A decode step (one id) costs one tile; 512 ids cost at most one call per run of needed tiles, fewer
when ids cluster. Under tracing (torch.compile, make_fx, export) ids have no values to group on, so the
op is ``F.embedding(ids, w.dequantize())``: a static graph in which the compiler can fuse the
dequantization into the gather (inductor does: no float weight is allocated, test_ties.py checks it).

Only the forward is served: the weight of a quantized embedding is frozen (``padding_idx``,
``scale_grad_by_freq`` and ``sparse`` only change gradients, so they are accepted and have no effect here).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from .affine_quantized_tensor import INPUT_SCALE, AffineQuantizedTensor
from .dispatch import fill_defaults

__all__ = ["embedding", "row_tile", "GAP_ELEMS", "CHUNK_ELEMS"]

aten = torch.ops.aten

GAP_ELEMS = 1 << 15      # unneeded elements worth dequantizing to save one slice call (Note [Quantized embedding])
CHUNK_ELEMS = 1 << 20    # largest slice dequantized at once: 4 MB of float32


def embedding(func, args, kwargs):
    """``aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False)``."""
    weight, indices = fill_defaults(args, 5, [-1, False, False])[:2]
    if isinstance(indices, AffineQuantizedTensor) or not isinstance(weight, AffineQuantizedTensor):
        raise NotImplementedError("embedding reads quantized weights only: the indices must be a plain integer "
                                  "tensor")
    if weight.dim() != 2:
        raise ValueError(f"embedding of a {weight.dim()}-d quantized tensor; embedding weights are 2-d")
    if indices.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(f"Expected tensor for argument #1 'indices' to have one of the following scalar types: "
                           f"Long, Int; but got {indices.dtype} instead (embedding of a quantized weight)")
    if is_fake(indices) or is_fake(weight) or _proxy_tracing():
        return F.embedding(indices, weight.dequantize())
    return _gather_rows(weight, indices)


def row_tile(weight: AffineQuantizedTensor) -> int:
    """Rows (of the outer tensor) a slice of ``weight`` must start at a multiple of: the layout's tile,
    widened to whole blocks, the rule ``layouts.slicing.block_slice`` applies along the stored dim."""
    sdim = 1 if weight.transposed else 0
    size, block = weight.logical_shape[sdim], weight.block_size[sdim]
    m = weight.qlayout.slice_multiple(weight.weight_format, sdim)
    return m if block == size else math.lcm(m, block)


def _proxy_tracing() -> bool:
    # make_fx on real tensors: values exist but must not be baked into the graph.
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _gather_rows(weight: AffineQuantizedTensor, indices: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    flat = indices.reshape(-1)
    if flat.numel() == 0:
        return torch.empty((*indices.shape, k), dtype=weight.dtype, device=weight.device)
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise IndexError(f"index out of range in self: id {bad} in an embedding of {n} rows (quantized weight "
                         f"{tuple(weight.shape)})")
    rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    # The layout picks rows of its own tensors; an input_scale (one per column) stays whole (with_changes keeps it)
    picked = weight.qlayout.gather_rows(weight.with_changes({INPUT_SCALE: None}), rows)
    if picked is not None:  # row-major storage: exactly the rows needed, one index_select per inner tensor
        table = weight.with_changes(picked, logical_shape=(rows.numel(), k)).dequantize()
        return table[inverse].reshape(*indices.shape, k)
    m = row_tile(weight)
    rows_per_chunk = max(m, CHUNK_ELEMS // k // m * m)
    bounds = [(a, min(b, n)) for a, b in _segments(rows, m, k) for a, b in _chunks(a, b, rows_per_chunk)]
    # Where each chunk's rows start and end in ``rows`` (sorted): one searchsorted for every chunk.
    edges = torch.searchsorted(rows, torch.tensor([a for a, _ in bounds] + [n], device=rows.device)).tolist()
    pieces = []
    for (a, b), i0, i1 in zip(bounds, edges, edges[1:]):
        dense = aten.slice.Tensor(weight, 0, a, b).dequantize()
        pieces.append(dense.index_select(0, rows[i0:i1] - a))
    table = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return table[inverse].reshape(*indices.shape, k)


def _segments(rows: torch.Tensor, m: int, k: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) (multiples of the tile ``m``) covering ``rows``, runs of needed tiles merged across
    gaps of at most GAP_ELEMS elements."""
    tiles = torch.unique_consecutive(rows // m)
    gap_tiles = tiles[1:] - tiles[:-1] - 1
    cut = torch.nonzero(gap_tiles * (m * k) > GAP_ELEMS).flatten()
    firsts = torch.cat([tiles[:1], tiles[cut + 1]]).tolist()
    lasts = torch.cat([tiles[cut], tiles[-1:]]).tolist()
    return [(f * m, (l + 1) * m) for f, l in zip(firsts, lasts)]


def _chunks(a: int, b: int, rows_per_chunk: int):
    for start in range(a, b, rows_per_chunk):
        yield start, min(start + rows_per_chunk, b)
