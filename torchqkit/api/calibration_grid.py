"""ConfigGrid: a weight config's own number grid, for algorithms that choose codes (GPTQ) or weights (AWQ).

The grid is what the config's handler does to a weight: its qparams come from the handler itself (the same
function round-to-nearest uses, so GPTQ's scales are the config's scales), codes of given columns from the
oracle's quantize_affine, and the final tensor is packed into the handler's layout with the handler's
attributes (activation spec, kernel preference): ordinary layout data.
"""
from __future__ import annotations

import dataclasses

import torch

from ..core.primitives import dequantize_affine, quantize_affine
from ..layouts.base import PlainParts
from ..layouts.plain import PlainLayout
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .configs.base import handler_for
from .quantize_weight import UnsupportedWeight

__all__ = ["ConfigGrid"]


class ConfigGrid:
    """``config``'s grid for ``weight`` (N, K); raises UnsupportedWeight when the config can't take it."""

    def __init__(self, config, weight: torch.Tensor, name: str):
        self.config, self.name, self.dtype = config, name, weight.dtype
        self.handler = handler_for(config)
        self.probe = self.handler(config, weight.detach(), name)
        if self.probe.block_size[0] != 1:
            raise UnsupportedWeight(f"{name}: {config.describe()} shares scales across output rows "
                                    f"(block {self.probe.block_size}); GPTQ / AWQ need row-wise groups")
        self.group_size = self.probe.block_size[1]
        self.fast = self._plain_twin(weight)

    def _plain_twin(self, weight):
        """The same config in PlainLayout when it gives the same qparams: searches call the grid many times, and
        packing into a tiled layout (then unpacking) each time only costs. Checked once on the real weight."""
        if not dataclasses.is_dataclass(self.config) or "layout" not in {f.name for f in dataclasses.fields(self.config)}:
            return self.config
        twin = dataclasses.replace(self.config, layout=PlainLayout())
        try:
            plain = self.handler(twin, self.probe.dequantize(torch.float32).to(self.dtype), self.name)
        except ValueError:
            return self.config
        mine = self.probe.qlayout.unpack(self.probe)
        theirs = plain.qlayout.unpack(plain)
        same = (torch.equal(mine.scale, theirs.scale) and plain.zero_point_domain == self.probe.zero_point_domain
                and (mine.zero_point is None) == (theirs.zero_point is None)
                and (mine.zero_point is None or torch.equal(mine.zero_point, theirs.zero_point)))
        return twin if same else self.config

    def quantized(self, w: torch.Tensor) -> AffineQuantizedTensor:
        """The config's quantization of ``w`` (possibly in PlainLayout: same codes and qparams, see _plain_twin)."""
        return self.handler(self.fast, w.to(self.dtype), self.name)

    def fake_quantize(self, w: torch.Tensor) -> torch.Tensor:
        """Quantize then dequantize with the config (round-to-nearest on its own qparams)."""
        return self.quantized(w).dequantize(torch.float32)

    def qparams(self, w: torch.Tensor):
        q = self.quantized(w)
        parts = q.qlayout.unpack(q)
        return parts.scale, parts.zero_point

    def group_qparams(self, w: torch.Tensor):
        """Qparams of one group's columns (N, <= group_size): quantizing just them costs K / g times less than
        the whole weight, and gives the same numbers (groups are independent; a partial group is the tail
        group, whose qparams come from its real values either way). Per-channel grids take the whole K."""
        if w.shape[1] == self.probe.logical_shape[1]:
            return self.qparams(w)
        try:
            return self.qparams(w)
        except UnsupportedWeight:  # a layout that can't hold so few columns: widened by copies of the first
            # column (the group's min / max stay its own), the others' qparams dropped
            extra = self.probe.logical_shape[1] - w.shape[1]
            full = torch.cat([w, w[:, :1].expand(-1, extra)], dim=1)
            scale, zero = self.qparams(full)
            return scale[:, :1], None if zero is None else zero[:, :1]

    def quantize_columns(self, w, scale, zero_point):
        p = self.probe
        codes = quantize_affine(w, p.qdtype, (1, 1), scale, zero_point, zero_point_domain=p.zero_point_domain,
                                check_finite=False, name=self.name)
        deq = dequantize_affine(codes, p.qdtype, (1, 1), scale, zero_point, zero_point_domain=p.zero_point_domain,
                                output_dtype=torch.float32, name=self.name)
        return codes, deq

    def pack(self, codes: torch.Tensor, scale, zero_point) -> AffineQuantizedTensor:
        """The handler's tensor with these codes (same qparams grid, layout and attributes)."""
        p = self.probe
        parts = PlainParts(codes.to(p.qdtype.storage_dtype), scale, zero_point)
        tensors = p.qlayout.pack(parts, p.weight_format)
        return AffineQuantizedTensor(tensors, **p.attributes())
