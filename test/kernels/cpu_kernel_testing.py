"""Helpers shared by the C++ CPU kernel tests: which ISA levels this CPU can run, one error budget, the log of
aten / custom ops a call dispatches, and the check that torch.compile calls an op."""
from __future__ import annotations

import os

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import torchqkit as qk
from torchqkit import kernels
from test.common import OpLog  # noqa: F401  (the kernel tests import it from here)

ISA_LEVELS = ["scalar", "avx2", "avx_vnni", "avx512_vnni", "avx512_bf16", "amx"]


def cpu_levels(op: str, with_avx_vnni: bool = False, with_avx512_bf16: bool = False, with_amx: bool = False) -> list[str]:
    """ISA levels the C++ kernel of ``op`` can be forced to here; [] without the kernel. avx_vnni only with
    ``with_avx_vnni``, avx512_bf16 only with ``with_avx512_bf16``, amx with either that (the bf16 panels) or
    ``with_amx`` (the int8 dynamic-activation panels): the op families without such a kernel run their AVX2 /
    AVX-512 VNNI code at that level."""
    if not kernels.CPU_EXTENSION_LOADED or not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"):
        return []
    env = os.environ.get("TORCHQKIT_CPU_ISA")
    levels = []
    try:
        for level in ISA_LEVELS:
            os.environ["TORCHQKIT_CPU_ISA"] = level
            try:
                torch.ops.torchqkit_cpu.isa()  # raises for a level this CPU lacks
            except RuntimeError:
                continue
            levels.append(level)
    finally:
        if env is None:
            os.environ.pop("TORCHQKIT_CPU_ISA", None)
        else:
            os.environ["TORCHQKIT_CPU_ISA"] = env
    return [lv for lv in levels if (with_avx_vnni or lv != "avx_vnni") and (with_avx512_bf16 or lv != "avx512_bf16")
            and (with_avx512_bf16 or with_amx or lv != "amx")]


def running_level(levels: list[str]) -> str:
    """The level kernels.cpu_backend names for an op with kernels at ``levels``: the level this session runs
    (TORCHQKIT_CPU_ISA's, else the CPU's best; avx_vnni is named as such where its ops run their AVX2 code), but
    AVX-512 VNNI at the avx512_bf16 and amx levels for an op without a bf16 kernel."""
    isa = torch.ops.torchqkit_cpu.isa()
    return "avx512_vnni" if isa in ("avx512_bf16", "amx") and isa not in levels else isa


def needs_kernel(levels: list[str]):
    return pytest.mark.skipif(not levels, reason=f"no C++ CPU kernel: {kernels.CPU_EXTENSION_REASON}")


def isa_param(levels: list[str]):
    return pytest.mark.parametrize("isa", levels or ["none"])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def quantized_linear(config, dtype=torch.float32) -> torch.nn.Linear:
    """A Linear(96, 48) with a fixed weight (randn * 0.05, seed 0), quantized by ``config``: what the config-level
    tests of each format's op run."""
    lin = torch.nn.Linear(96, 48).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 96, generator=gen(0)) * 0.05)
    qk.quantize_(lin, config)
    return lin


def assert_rel(out, ref, tol, what=""):
    """max |out - ref| <= tol * max |ref|: one error budget relative to the output's magnitude."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    err = (out.float() - ref.float()).abs().max().item()
    bound = tol * max(ref.float().abs().max().item(), 1e-30)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g} (tol {tol:g} x max |ref|)"


def assert_every_token_count(call, reference, w, tol, what: str, counts=range(1, 10)):
    """``call(w, x, bias)`` = ``reference(w, x, bias)`` (``assert_rel`` with ``tol[dtype]``) for M = each of ``counts``
    tokens (default 1..9: every tile remainder of the dot kernels, AVX-512 tiles of 4, AVX2 of 2, and the first
    count past them) in float32 and bfloat16; activations randn * 3 seeded by M, a fixed bias."""
    n, k = w.shape
    bias = torch.randn(n, generator=gen(2))
    for m in counts:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, k, generator=gen(m)) * 3).to(dtype)
            assert_rel(call(w, x, bias.to(dtype)), reference(w, x, bias.to(dtype)), tol[dtype], f"{what} M={m} {dtype}")


def unaligned(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """A copy of t whose data starts `offset_bytes` past a 64-byte boundary (as safetensors can return)."""
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + 64 + offset_bytes, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 64 + offset_bytes
    out = buf[start:start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out




def assert_compiled_calls_op(module, x, op: str):
    """torch.compile(fullgraph=True) of ``module`` calls torchqkit::``op`` in its generated code and returns
    exactly the eager output."""
    torch._dynamo.reset()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(module, fullgraph=True), x)
        eager = module(x)
    assert f"torch.ops.torchqkit.{op}.default" in "\n".join(code)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
