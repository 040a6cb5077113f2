"""Which C++ CPU kernel serves an op, and why: the level the extension runs now, what its kernel does there, and
the per-call settings that change its route.

The extension picks its ISA level at run time (AMX, AVX-512 + AVX512-BF16, AVX-512 VNNI, AVX-VNNI, AVX2 + FMA, or
scalar); the environment variable ``TORCHQKIT_CPU_ISA=amx|avx512_bf16|avx512_vnni|avx_vnni|avx2|scalar`` forces
any level the CPU runs (read on every call); ``avx512_vnni`` then means AVX-512 without bf16 dot products, and
``amx`` the avx512_bf16 kernels with the weight-only prefill's bf16 panels on AMX tiles.
What each kernel does at each level is written in C++ next to the kernel and read from the extension
(``torchqkit_cpu::kernel_descriptions()``, Note [Kernel descriptions] in csrc/cpu/kernel_descriptions.cpp); this
module adds what changes per call: the level chosen, torch's fp32 matmul precision, the fp32 prefill route.
"""
from __future__ import annotations

import functools
import json
import os

import torch

from . import loading
from .registry import op_def

__all__ = ["cpu_backend", "cpu_kernel_descriptions"]

@functools.cache  # the extension's descriptions don't change while it is loaded
def cpu_kernel_descriptions() -> dict:
    """{op: {"levels": {isa: {"runs", "text"}}, "fp32_in_bf16_from", "fp32_planes_from", "fp32_prefill_routes"}}
    as the loaded C++ CPU extension describes its kernels; {} without the extension."""
    loaded = loading.CPU_EXTENSION_LOADED and hasattr(torch.ops.torchqkit_cpu, "kernel_descriptions")
    return json.loads(torch.ops.torchqkit_cpu.kernel_descriptions()) if loaded else {}


def _fp32_activations_note(described: dict, isa: str) -> str:
    """Which kernels float32 activations take at the avx512_bf16 / amx level, as torch's fp32 matmul precision says
    now (Note [fp32 activations in bf16] in csrc/cpu/fp32_matmul_precision.h)."""
    if torch.ops.torchqkit_cpu.fp32_takes_bf16():
        return (f" | float32 activations: {described['fp32_in_bf16_from']} in the bf16 kernels (x rounded to bf16 "
                f"once), because torch's fp32 matmul precision allows bf16 (set_float32_matmul_precision('medium') / "
                f"torch.backends.mkldnn.matmul.fp32_precision = 'bf16'); below that the fp32 kernels")
    if isa == "amx" and described["fp32_planes_from"]:
        return (f" | float32 activations: {described['fp32_planes_from']} the AMX prefill on x split into three bf16 "
                f"planes that sum to it exactly (3x the tile work, fp32 precision: Note [fp32 activations on AMX]; "
                f"nf4 excepted); below that the fp32 kernels")
    return (" | float32 activations: the fp32 kernels (torch's fp32 matmul precision is not 'medium' / mkldnn "
            "'bf16'; with it, the prefill would take the bf16 kernels)")


# The GEMMs the float32 prefill of the weight-only ops can run on (Note [fp32 prefill by sgemm] in
# csrc/cpu/registration.cpp), as torchqkit_cpu::fp32_prefill_route() names them.
_FP32_PREFILL_ROUTE = {"panels": "this project's fp32 panels", "sgemm": "ATen's sgemm on dequantized rows"}


def _fp32_prefill_note(described: dict, isa: str) -> str:
    """Which GEMM the float32 prefill of the op runs on at the selected level on this CPU (read per call, like the
    route itself)."""
    if not described["fp32_prefill_routes"] or not hasattr(torch.ops.torchqkit_cpu, "fp32_prefill_route"):
        return ""
    route = torch.ops.torchqkit_cpu.fp32_prefill_route()
    forced = os.environ.get("TORCHQKIT_CPU_FP32_PREFILL")
    if isa == "scalar":
        return f" | float32 prefill here: {_FP32_PREFILL_ROUTE[route]} (the scalar level's only one)"
    if forced:
        return f" | float32 prefill here: {_FP32_PREFILL_ROUTE[route]} (TORCHQKIT_CPU_FP32_PREFILL={forced})"
    if os.environ.get("TORCHQKIT_CPU_ROUTES") == "rules":
        return f" | float32 prefill here: {_FP32_PREFILL_ROUTE[route]} (this CPU's default; TORCHQKIT_CPU_ROUTES=rules)"
    return (f" | float32 prefill here: the route measured fastest per case at its first call (kernels.routes() lists "
            f"them; Note [Routes chosen by measurement]), else {_FP32_PREFILL_ROUTE[route]} (this CPU's default)")


def cpu_backend(op: str) -> tuple[str, str]:
    """(backend, reason) serving custom op ``op`` (e.g. "torchqkit::linear_int8wo_plain") on CPU."""
    op_def(op)  # unknown ops raise, naming the known ones
    if not loading.CPU_EXTENSION_LOADED:
        return "reference", loading.CPU_EXTENSION_REASON
    if op not in loading.CPU_OPS:
        return "reference", "csrc/cpu has no kernel for this op: its pure-PyTorch reference runs on CPU"
    isa = torch.ops.torchqkit_cpu.isa()
    forced = os.environ.get("TORCHQKIT_CPU_ISA")
    why = f"forced by TORCHQKIT_CPU_ISA={forced}" if forced else "best level this CPU runs"
    described = cpu_kernel_descriptions().get(op)
    level = described["levels"].get(isa) if described else None
    if level is None:
        return f"cpp {isa}", (f"{why}; the C++ CPU extension describes no {isa} kernel of this op (rebuild it: "
                              f"Note [Kernel descriptions] in csrc/cpu/kernel_descriptions.cpp)")
    fp32 = ""
    if level["runs"] == isa and isa in ("avx512_bf16", "amx") and described["fp32_in_bf16_from"]:
        fp32 = _fp32_activations_note(described, isa)
    return f"cpp {level['runs']}", f"{why}; {level['text']}{fp32}{_fp32_prefill_note(described, isa)}"
