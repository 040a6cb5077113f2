"""How a Triton launcher becomes a ``torchqkit_triton::`` op, and which autotune configs each GPU family gets.

Why the namespace exists: Note [Why a torchqkit_triton namespace] in __init__.py. On a real GPU,
``torch.library.triton_op`` (Inductor traces into the kernel through ``wrap_triton``); under ``TRITON_INTERPRET=1``
a plain ``torch.library.custom_op`` with a fake impl, because torch.compile can't trace a triton_op when the
interpreter runs (docs/platform.md, "Triton on CPU").
The launcher body is the same in both cases: it launches through ``traceable(kernel)``, which is ``wrap_triton`` on a
GPU and the kernel itself under the interpreter (there the op is opaque to torch.compile anyway, and torch 2.11's
``wrap_triton`` can't take an interpreted kernel: it looks for the compiled kernel's ``.fn``).
"""
from __future__ import annotations

import os

import torch
import triton
from torch.library import wrap_triton

from ..registry import op_def

__all__ = ["INTERPRET", "TRITON_OPS", "register", "gpu_family", "matmul_configs", "gemv_configs", "dot_precision",
           "launch_tiled", "traceable"]

# Read once, like triton itself (it decides at @triton.jit time): conftest.py sets it before any import.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_OPS: dict[str, str] = {}  # "torchqkit::op" -> "torchqkit_triton::op"


def register(op: str, schema_fn):
    """Register launcher ``schema_fn`` as ``torchqkit_triton::<op>`` (``op`` names the torchqkit op it mirrors, whose
    fake impl it shares: kernels/registry.py)."""
    name = f"torchqkit_triton::{op}"
    fake_fn = op_def(f"torchqkit::{op}").fake
    define = torch.library.custom_op if INTERPRET else torch.library.triton_op
    custom = define(name, schema_fn, mutates_args=())
    custom.register_fake(fake_fn)
    TRITON_OPS[f"torchqkit::{op}"] = name
    return custom


def gpu_family() -> str:
    """"interpreter", "sm80" (A100 class), "sm89" (Ada), "sm90" (Hopper), "sm100" (Blackwell+) or "hip"."""
    if INTERPRET:
        return "interpreter"
    if torch.version.hip is not None:
        return "hip"
    major, minor = torch.cuda.get_device_capability()
    if major >= 10:
        return "sm100"
    return {(9, 0): "sm90", (8, 9): "sm89"}.get((major, minor), "sm80")


def _cfg(bm, bn, bk, warps, stages, **extra):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=warps, num_stages=stages)


def matmul_configs(family: str, k_multiple: int = 32) -> list[triton.Config]:
    """Tiles for the dequantize-in-the-loop GEMMs. BLOCK_K must be a multiple of ``k_multiple`` (a format's
    block: 32 for MX, the k-chunk for int4 tiles). The interpreter gets one big tile: its cost is per program
    and per op, and autotuning there would run every config."""
    bk = max(k_multiple, 32)
    if family == "interpreter":
        return [_cfg(64, 64, max(bk, 64), 4, 1)]
    if family == "hip":
        return [_cfg(64, 64, bk, 4, 2), _cfg(128, 64, bk, 8, 2)]
    if family == "sm89":  # 100 KB shared memory: fewer stages than Hopper / A100
        return [_cfg(16, 64, bk, 4, 3), _cfg(64, 64, bk, 4, 3), _cfg(128, 128, bk, 8, 2)]
    stages = 4 if family in ("sm90", "sm100") else 3
    return [_cfg(16, 64, bk, 4, stages), _cfg(64, 128, bk, 4, stages), _cfg(128, 128, bk, 8, stages),
            _cfg(128, 256, bk, 8, 3)]


def gemv_configs(family: str, k_multiple: int = 32) -> list[triton.Config]:
    """Split-K decode tiles: SPLIT_K programs share one column block's K range."""
    bk = max(k_multiple, 32)
    if family == "interpreter":
        return [triton.Config({"BLOCK_N": 64, "BLOCK_K": max(bk, 128), "SPLIT_K": 2}, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk * f, "SPLIT_K": s}, num_warps=w)
            for bn, f, s, w in ((32, 2, 4, 4), (64, 1, 8, 4), (16, 4, 16, 2), (64, 2, 2, 4))]


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 activations: exact IEEE products (the GPU default would be TF32, looser than the reference).
    Other dtypes: None, the backend's default (naming "tf32" would be refused on AMD targets without it)."""
    return "ieee" if dtype == torch.float32 else None


def traceable(kernel):
    """``kernel`` as a launcher calls it: through ``wrap_triton`` on a GPU, so Inductor traces into the kernel of a
    triton_op; as it is under the interpreter (see the module docstring)."""
    return kernel if INTERPRET else wrap_triton(kernel)


def launch_tiled(kernel, m: int, n: int, *args, **meta) -> None:
    """Launch an autotuned GEMM ``kernel`` on the (M tiles, N tiles) grid; nothing to do when the output is empty."""
    if m and n:
        grid = lambda cfg: (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))  # noqa: E731
        traceable(kernel)[grid](*args, **meta)
