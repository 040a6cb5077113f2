"""Triton backends of the torchqkit ops, one file per kernel; the GEMMs share one K loop (tiles.py) and differ
only in their weight-tile loader. Importing this package needs triton.

Each file defines a ``torchqkit_triton::<op>`` op with the same schema and fake impl as the ``torchqkit::<op>`` it
implements (``kernels/ops/``; registration.py reads both from the registry, TRITON_OPS lists what registered).
On a GPU without a C++ CUDA kernel for the op, kernels/loading.py also puts it on the ``torchqkit::<op>`` CUDA key,
so AUTO reaches it through the one op. On CUDA these ops are ``torch.library.triton_op`` + ``wrap_triton``
(Inductor traces into the kernel); under ``TRITON_INTERPRET=1`` on CPU the same launcher is a plain custom op.

Note [Why a torchqkit_triton namespace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The design asks for one op per format with backends per dispatch key, and AUTO follows it. The second namespace
stays for what a dispatch key can't express, an explicit ``KernelPreference.TRITON``:
- A dispatch key names a device, not a backend. Where csrc/cuda has a kernel, the ``torchqkit::`` CUDA key holds
  it; on CPU the CPU key holds the C++ kernel. TRITON must still run the Triton kernel on those tensors, so it
  needs a handle the dispatcher won't send elsewhere.
- That handle must be an op, not the Python launcher: under the interpreter torch.compile can't trace the
  launcher (dynamo refuses the interpreted ``wrap_triton`` call: "Attempted to call function marked as skipped",
  checked with torch 2.13 / triton 3.9; docs/platform.md), while a custom op with a fake impl compiles fullgraph
  (test/kernels/triton/test_layout_paths.py). On a GPU, triton_op is what lets Inductor trace into the kernel.
- An op also shows in dispatch traces and profiles, so a test can check that the Triton kernel ran.
It holds no second definition: schema and fake come from the torchqkit op, TRITON_OPS is filled by registration,
and a test compares every schema with its torchqkit op's.
"""
from . import (float8_rowwise, float8_weight_only, fp6_weight_only, int4_tiled_gemm, int4_tiled_gemv, int8_weight_only,
               intx_weight_only, mx_weight_only, nf4_weight_only, nm_sparse_weight_only, nvfp4_weight_only,
               quantized_kv_attention)
from .registration import INTERPRET, TRITON_OPS, gpu_family

__all__ = ["INTERPRET", "TRITON_OPS", "gpu_family", "float8_rowwise", "float8_weight_only", "int4_tiled_gemm", "int4_tiled_gemv",
           "int8_weight_only", "mx_weight_only", "nf4_weight_only", "nvfp4_weight_only", "fp6_weight_only",
           "nm_sparse_weight_only", "intx_weight_only", "quantized_kv_attention"]
