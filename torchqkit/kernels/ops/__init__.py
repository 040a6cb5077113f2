"""One module per ``torchqkit::`` custom op (schema, fake, reference, autograd: registry.define_linear_op).
Importing this package defines them all, in this order (``registry.OPS``)."""
from . import (linear_int8wo_plain, linear_int8da_int8_plain, linear_int4wo_tiled, linear_nf4wo,  # noqa: F401
               linear_fp8wo, linear_mxwo, linear_nvfp4wo, linear_fp6wo, scaled_mm_fp8_rowwise, linear_intxwo,
               linear_int8da_int4_packed, linear_ternarywo, linear_nm_sparse_wo, sdpa_over_filled_cache,
               sdpa_quantized_kv_cache, kv_cache_append, fake_quantize_activation, grouped_linear)
