"""Which implementation serves each quantized op, and why.

Importing this package defines every ``torchqkit::`` custom op (one module each under ``ops/``, through
``registry.define_linear_op``: schema, fake, reference, autograd), then loads the backends that register kernels on
them (loading.py: the C++ CPU and CUDA extensions, the Triton kernels). Without a built backend every op still
runs, on its reference. ``choose_backend`` / ``linear_op`` (choice.py) pick the backend per op, device and
KernelPreference; ``cpu_backend`` (cpu_kernels.py) says which C++ CPU kernel runs and why; ``routes()`` (routes.py)
which route each case measured fastest; ``status()`` (status.py) puts it all in one table. This file only gathers their names.
"""
from __future__ import annotations

from . import ops, reference  # noqa: F401  (ops: defines every op)
from .choice import _why_not, choose_backend, linear_op  # noqa: F401  (_why_not: tests ask it directly)
from .cpu_kernels import cpu_backend, cpu_kernel_descriptions
from .loading import (CPU_EXTENSION_LOADED, CPU_EXTENSION_REASON, CPU_OPS, CUDA_EXTENSION_LOADED,
                      CUDA_EXTENSION_REASON, CUDA_OPS, KERNEL_ACT_DTYPES, MISSING_KERNELS_NOTE,
                      register_triton_for_cuda_key, triton_backend)
from .cpu_build import read_record  # noqa: F401
from .missing import (KernelsMissingWarning, missing_kernels_note, missing_kernels_warned,  # noqa: F401
                      warn_missing_kernels)
from .preference import KernelPreference
from .registry import OPS, op_def
from .routes import clear_routes, load_routes, route_cache_key, routes, save_routes
from .status import backend_status, format_status, register_status_rows, route_status, status

__all__ = ["status", "format_status", "cpu_backend", "cpu_kernel_descriptions", "choose_backend", "linear_op",
           "backend_status", "register_status_rows", "KernelPreference", "KERNEL_ACT_DTYPES", "CPU_EXTENSION_LOADED",
           "CPU_EXTENSION_REASON", "CPU_OPS", "CUDA_EXTENSION_LOADED", "CUDA_EXTENSION_REASON", "CUDA_OPS",
           "KernelsMissingWarning", "MISSING_KERNELS_NOTE", "missing_kernels_warned", "triton_backend",
           "register_triton_for_cuda_key", "OPS", "op_def", "routes", "clear_routes", "save_routes", "load_routes",
           "route_cache_key", "route_status"]
