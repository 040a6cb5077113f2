"""The op table of AffineQuantizedTensor itself (filled by generic_ops.py); the table type and the lookup
error live with the layouts (layouts/op_table.py), which own the per-layout tables."""
from __future__ import annotations

from ..layouts.op_table import OpTable, UnsupportedOpError, fill_defaults

__all__ = ["OpTable", "UnsupportedOpError", "fill_defaults", "GENERIC_OPS", "EXPERT_OPS"]

# Ops every layout gets from AffineQuantizedTensor itself (filled by generic_ops.py); a layout's own
# table is consulted first.
GENERIC_OPS = OpTable("AffineQuantizedTensor")

# Ops of a stack of expert weights (E, N, K), filled by experts.py: the layouts' tables take 2-d weights only.
EXPERT_OPS = OpTable("AffineQuantizedTensor (experts)")
