"""NMSparseLayout: an N:M sparse weight stored as its kept values (or codes) and their positions.

Tensors (R = out_features; Kp = K padded to whole M-blocks, and to whole groups for a group-wise scale, see
Note [Partial blocks] in core/primitives.py; E = Kp / m * n kept entries per row):
  kept:       the E kept codes of each row in the order of Note [N:M sparse storage] (layouts/nm_format.py):
              1..7-bit integer codes as offset-binary fields packed with pack_intx_fields (Note [Packed intx bits],
              layouts/packed_intx.py): uint8 (R, ceil(E * bits / 8)); 8-bit integer codes in their storage dtype
              (int8 / uint8) (R, E); float8 codes as float8 and float values (Note [Float identity codes],
              core/qdtype.py) in their float dtype, (R, E)
  positions:  uint8 (R, ceil(E * b / 8)), b = position_bits(m) (2 for 2:4), as nm_format.pack_nm stores them
  scale:      (ceil(R / block_size[0]), ceil(K / block_size[1])), as the dense layouts store it
  zero_point: same shape as scale, or None (ZeroPointDomain.NONE)
Every block of M columns keeps exactly N entries (a block whose weight has fewer nonzeros keeps some zeros). Rows
start on byte boundaries, so slicing out_features is a row view; slices along K cut whole M-blocks, bytes and groups.

Linear (routes below): integer codes weight-only: ``torchqkit::linear_nm_sparse_wo`` on the kept codes and positions
(C++ CPU kernels, and on CUDA tensors Triton kernels, that read only the stored bytes); float values, float8 codes and
dynamic activations: the reference (dequantize, pruned entries 0, F.linear); ``torchqkit.kernels.status()`` lists both.

Note [Pruned entries read as zero]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pruned entry is not stored, and it must dequantize to exactly 0. In the INT and NONE zero-point domains some code
does (the zero point, or 0), but in the FLOAT domain of Int4WeightOnlyConfig, w = (q - mid) * s + z, no code need
give 0. So the layout exposes what it stores: ``unpack`` returns, besides the codes, ``PlainParts.mask`` (True at
stored entries), and ``AffineQuantizedTensor.dequantize`` sets the entries outside the mask to 0 after the oracle's
dequantization; kernels only ever read the stored entries. The codes ``unpack`` returns at pruned entries are the
code of 0.0 in their block (``quantize_affine`` of zeros: the zero point, 0, or in the FLOAT domain the nearest
code), so a reader that ignores the mask is still as close to 0 as the format allows. The alternative, moving
int4 to the INT domain, would change the base config's own numbers; the mask keeps them.
A weight packed without a mask (``quantize_weight(..., layout=NMSparseLayout())``, a LoRA merge quantizing the sum
again) keeps the N largest dequantized magnitudes of each block: magnitude pruning of the codes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.primitives import ZeroPointDomain, dequantize_affine, quantize_affine
from ..core.qdtype import QKind
from ..kernels.ops.linear_intxwo import pack_intx_fields
from .base import Layout, PackedSpec, PlainParts, WeightFormat, pad_features, register_layout, scale_specs
from .nm_format import check_nm_mask, check_pattern, nm_mask, pack_nm, position_bits
from .routes import Route, on_fake_quantized_input, reference_linear

__all__ = ["NMSparseLayout"]


@register_layout("nm_sparse")
@dataclass(frozen=True)
class NMSparseLayout(Layout):
    """An N:M sparse weight: the ``n`` kept values of every block of ``m`` consecutive input features, and their
    positions (layout name ``"nm_sparse"``).

    Stores integer codes of 1 to 8 bits (packed like ``PackedIntxLayout`` below 8 bits), float8 codes, or the float
    values themselves (``SparsityConfig(base=None)``), with the positions in log2(m) bits each (2 for 2:4): 2:4 with
    int4 codes takes 0.75 of the dense int4 bytes, with bfloat16 values 0.5625 of the dense bfloat16 bytes (plus
    scales). Inner tensors: ``kept``, ``positions``, ``scale`` and ``zero_point`` (None without a zero point). Pruned
    entries dequantize to exactly 0 (Note [Pruned entries read as zero]). ``SparsityConfig`` puts weights in it;
    given a dense weight (``quantize_weight``), it keeps the ``n`` largest dequantized magnitudes of each block.

    Args:
        n (int): entries kept per block; default 2.
        m (int): block length along in_features; default 4. 1 <= n < m <= 128.

    Raises:
        ValueError: ``(n, m)`` is not an N:M pattern.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(64, 128), qk.qdtypes.int8, qk.PerRow(), qk.NMSparseLayout(2, 4))
        assert (w.dequantize().reshape(64, 32, 4) != 0).sum(-1).max() <= 2
        print(w.packed_nbytes())           # 64 * (64 kept + 16 position bytes) + 64 * 4 scale bytes
        ```
    """
    n: int = 2
    m: int = 4
    tensor_names = ("kept", "positions", "scale", "zero_point")
    row_major = True

    def __post_init__(self):
        check_pattern(self.n, self.m, "NMSparseLayout(n, m)")

    def supports(self, fmt: WeightFormat):
        qdtype, block_size, shape, _ = fmt
        if qdtype.kind is QKind.CODEBOOK or (qdtype.kind is QKind.INT and qdtype.bits > 8):
            return (f"NMSparseLayout stores integer codes of 1..8 bits, float8 codes or float values, not "
                    f"{qdtype.name}")
        if len(shape) != 2:
            return f"NMSparseLayout stores 2-d (out_features, in_features) weights, got shape {tuple(shape)}"
        g = block_size[1]
        if g != shape[1] and g % self.m:
            return (f"{self!r}: groups of {g} input features don't hold whole blocks of {self.m}; use a group size "
                    f"that is a multiple of {self.m}, or one scale per row")
        return None

    # ------------------------------------------------------------------ sizes
    def stored_k(self, fmt: WeightFormat) -> int:
        """K padded to whole M-blocks, and to whole groups when the scale is group-wise along K."""
        k, g = fmt.shape[1], fmt.block_size[1]
        unit = self.m if g == k else g
        return -(-k // unit) * unit

    def kept_bits(self, qdtype) -> int:
        """Bits of one packed kept field, or 0 when kept entries are whole elements (8-bit codes, float8, floats)."""
        return qdtype.bits if qdtype.kind is QKind.INT and qdtype.bits < 8 else 0

    def _entries(self, k: int) -> int:
        return k // self.m * self.n

    def _row_bytes(self, entries: int, bits: int) -> int:
        return -(-entries * bits // 8)

    def packed_specs(self, fmt: WeightFormat):
        qdtype, block_size, shape, zero_point_domain = fmt
        e, bits = self._entries(self.stored_k(fmt)), self.kept_bits(qdtype)
        kept = (PackedSpec((shape[0], self._row_bytes(e, bits)), (torch.uint8,)) if bits
                else PackedSpec((shape[0], e), (qdtype.storage_dtype,)))
        positions = PackedSpec((shape[0], self._row_bytes(e, position_bits(self.m))), (torch.uint8,))
        return {"kept": kept, "positions": positions, **scale_specs(shape, block_size, zero_point_domain)}

    # ------------------------------------------------------------------ pack / unpack
    def pack(self, parts: PlainParts, fmt: WeightFormat):
        qdtype = fmt.qdtype
        rows, k = fmt.shape
        kp = self.stored_k(fmt)
        codes = _pad_columns(parts.qdata, kp, 0)
        if parts.mask is None:  # magnitude pruning of the codes: Note [Pruned entries read as zero]
            values = dequantize_affine(parts.qdata, qdtype, fmt.block_size, parts.scale, parts.zero_point,
                                       zero_point_domain=fmt.zero_point_domain, name="weight")
            scores = _pad_columns(values.abs(), kp, -1.0)  # padding is never kept while a real column is free
            mask = nm_mask(scores, self.n, self.m)
        else:
            if parts.mask.shape != (rows, k) or parts.mask.dtype != torch.bool:
                raise ValueError(f"{self!r}: the mask must be a bool tensor of the weight's shape {(rows, k)}, got "
                                 f"{parts.mask.dtype} {tuple(parts.mask.shape)}")
            mask = _pad_columns(parts.mask, kp, False)
            check_nm_mask(mask, self.n, self.m, "the weight's mask")
            # exactly n entries per block: a block with fewer keeps its lowest other positions, whose codes are the
            # caller's (the code of a pruned weight's 0.0, or padding)
            mask = nm_mask(mask.to(torch.float32), self.n, self.m)
        kept, positions = pack_nm(_as_bytes(codes), mask, self.n, self.m)
        kept = kept.view(codes.dtype)
        bits = self.kept_bits(qdtype)
        if bits:
            kept = pack_intx_fields((kept.to(torch.int16) - int(qdtype.qmin)).to(torch.uint8), bits)
        return {"kept": kept, "positions": positions, "scale": parts.scale, "zero_point": parts.zero_point}

    def kept_codes(self, aqt) -> torch.Tensor:
        """The kept entries' codes (R, E) in the qdtype's storage dtype."""
        qdtype = aqt.qdtype
        bits = self.kept_bits(qdtype)
        if not bits:
            return aqt.kept
        e = self._entries(self.stored_k(aqt.weight_format))
        return (_fields(aqt.kept, bits, e).to(torch.int16) + int(qdtype.qmin)).to(qdtype.storage_dtype)

    def unpack(self, aqt) -> PlainParts:
        fmt = aqt.weight_format
        rows, k = fmt.shape
        kp = self.stored_k(fmt)
        # one-hot per block, no scatter: elementwise ops and reductions only, which inductor fuses safely (see _fields)
        pos = _fields(aqt.positions, position_bits(self.m), self._entries(kp)).reshape(rows, -1, self.n, 1)
        hit = pos == torch.arange(self.m, device=pos.device)  # (R, blocks, n, m): entry j sits at position p
        mask = hit.any(2).reshape(rows, kp)[:, :k]
        kept = self.kept_codes(aqt)
        bits = _as_int(kept).reshape(rows, -1, self.n, 1)
        dense = torch.where(hit, bits, torch.zeros((), dtype=bits.dtype, device=bits.device)).sum(2, dtype=bits.dtype)
        dense = dense.reshape(rows, kp)[:, :k].view(kept.dtype)  # one entry per position: the sum is that entry
        zero = _zero_codes(aqt, fmt)
        codes = dense if zero is None else torch.where(mask, dense, zero)
        return PlainParts(codes, aqt.scale, aqt.zero_point, mask)

    # ------------------------------------------------------------------ slicing
    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        if dim == 0:
            return super().slice_multiple(fmt, dim)
        # whole M-blocks whose kept fields and positions fill whole bytes
        unit_blocks = 1
        for bits in (position_bits(self.m), self.kept_bits(fmt.qdtype)):
            if bits:
                unit_blocks = math.lcm(unit_blocks, 8 // math.gcd(self.n * bits, 8))
        unit = unit_blocks * self.m
        block_k, k = fmt.block_size[1], fmt.shape[1]
        return unit if block_k == k else math.lcm(unit, block_k)

    def narrow(self, aqt, cut):
        """Rows along out_features; whole M-blocks, bytes and groups along in_features: always a view."""
        if cut.dim == 0:
            begin, length = cut.codes
            tensors = {"kept": aqt.kept.narrow(0, begin, length), "positions": aqt.positions.narrow(0, begin, length)}
        else:
            fmt = aqt.weight_format
            begin, length = cut.codes  # begin is a multiple of slice_multiple: whole blocks and bytes
            new_k = self.stored_k(fmt._replace(shape=(fmt.shape[0], length), block_size=cut.block_size))
            first, count = self._entries(begin), self._entries(new_k)
            tensors = {"kept": _narrow_fields(aqt.kept, first, count, self.kept_bits(aqt.qdtype)),
                       "positions": _narrow_fields(aqt.positions, first, count, position_bits(self.m))}
        for name in ("scale", "zero_point"):
            t = getattr(aqt, name)
            tensors[name] = None if t is None else t.narrow(cut.dim, *cut.blocks)
        return tensors, self

    def __repr__(self) -> str:
        return f"NMSparseLayout(n={self.n}, m={self.m})"


def _nm_sparse_call(fn, w, x, bias):
    layout = w.qlayout
    return fn(pad_features(x, layout.stored_k(w.weight_format)), w.kept, w.positions, w.scale, w.zero_point,
              layout.n, layout.m, w.qdtype.bits, w.qdtype.signed, ZeroPointDomain(w.zero_point_domain).value, bias)


NMSparseLayout.routes = (
    Route("integer codes of 1..8 bits, weight-only (any zero point domain, per-group / per-row)",
          lambda w, x: w.act_quant is None and w.qdtype.kind is QKind.INT, op="torchqkit::linear_nm_sparse_wo",
          call=_nm_sparse_call),
    Route("integer codes of 1..8 bits x quantized activations: activations fake-quantized, then the weight-only "
          "kernel", lambda w, x: w.act_quant is not None and w.qdtype.kind is QKind.INT,
          op="torchqkit::linear_nm_sparse_wo", call=on_fake_quantized_input(_nm_sparse_call)),
    Route("float values or float8 codes", lambda w, x: True, aten=reference_linear,
          aten_name="reference (dequantize with pruned entries 0, activations fake-quantized, then F.linear)",
          why="no N:M kernel reads float / float8 kept values yet; the reference computes the same product in "
              "float32"),
)


def _fields(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` ``bits``-bit fields of each row of ``packed`` (Note [Packed intx bits]), int32. Decoded by
    expanding the bytes into bits, not by indexing bytes (kernels/ops/linear_intxwo.intx_fields): with that
    gather, inductor miscompiled the dequantization of 3-bit positions in a K-padded weight."""
    rows = packed.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(rows, -1)[:, : count * bits]
    weights = torch.tensor([1 << b for b in range(bits)], dtype=torch.int32, device=packed.device)
    return (stream.reshape(rows, count, bits).to(torch.int32) * weights).sum(-1, dtype=torch.int32)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a signed integer tensor of the same element size (a view)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 codes as their bytes (a view): torch's gather / scatter have no float8 kernels."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _pad_columns(t: torch.Tensor, k: int, value) -> torch.Tensor:
    if t.shape[1] == k:
        return t
    out = torch.full((t.shape[0], k), value, dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out


def _narrow_fields(t: torch.Tensor, first: int, count: int, bits: int) -> torch.Tensor:
    """Entries [first, first + count) of each row: elements, or (bits > 0) packed fields starting on a byte."""
    if not bits:
        return t.narrow(1, first, count)
    start = first * bits // 8
    return t.narrow(1, start, -(-(first + count) * bits // 8) - start)


def _zero_codes(aqt, fmt: WeightFormat) -> torch.Tensor | None:
    """The code of 0.0 for every entry (logical shape), or None when it is code 0 everywhere (no zero point)."""
    if fmt.zero_point_domain is ZeroPointDomain.NONE:
        return None
    zeros = torch.zeros(fmt.shape, dtype=torch.float32, device=aqt.scale.device)
    return quantize_affine(zeros, fmt.qdtype, fmt.block_size, aqt.scale, aqt.zero_point,
                           zero_point_domain=fmt.zero_point_domain, check_finite=False, name="weight")
