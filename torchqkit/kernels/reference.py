"""Every op's pure-PyTorch reference and each format's decoder, gathered from the op modules (``kernels/ops/``)
for tests and benchmarks: ``linear_<op>_ref`` has the op's arguments; ``*_weight`` decodes stored bytes."""
from __future__ import annotations

from .ops.linear_fp8wo import fp8_weight, linear_fp8wo_ref
from .ops.linear_int4wo_tiled import int4_tiled_codes, int4_tiled_weight, linear_int4wo_tiled_ref
from .ops.linear_int8da_int4_packed import int4_packed_weight, linear_int8da_int4_packed_ref
from .ops.linear_int8da_int8_plain import linear_int8da_int8_plain_ref
from .ops.linear_int8wo_plain import int8_plain_weight, linear_int8wo_plain_ref
from .ops.linear_intxwo import intx_fields, intx_weight, linear_intxwo_ref
from .ops.linear_mxwo import linear_mxwo_ref, mx_weight
from .ops.linear_nf4wo import linear_nf4wo_ref, nf4_absmax, nf4_weight
from .ops.scaled_mm_fp8_rowwise import scaled_mm_fp8_rowwise_ref
from .ops.sdpa_over_filled_cache import sdpa_over_filled_cache_ref
from .ops.kv_cache_append import kv_cache_append_ref
from .ops.sdpa_quantized_kv_cache import kv_rows, sdpa_quantized_kv_cache_ref

__all__ = ["fp8_weight", "linear_fp8wo_ref", "int4_tiled_codes", "int4_tiled_weight", "linear_int4wo_tiled_ref",
           "int4_packed_weight", "linear_int8da_int4_packed_ref", "linear_int8da_int8_plain_ref", "int8_plain_weight",
           "linear_int8wo_plain_ref", "intx_fields", "intx_weight", "linear_intxwo_ref", "linear_mxwo_ref", "mx_weight",
           "linear_nf4wo_ref", "nf4_absmax", "nf4_weight", "scaled_mm_fp8_rowwise_ref",
           "sdpa_over_filled_cache_ref", "kv_rows", "sdpa_quantized_kv_cache_ref", "kv_cache_append_ref"]
