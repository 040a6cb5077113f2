"""The 256-bit fp32 panels of the dequantized weight-only prefill (csrc/cpu/fp32_panels256.cpp, Note [fp32 panels at
256 bits] in csrc/cpu/sgemm_prefill.h): at the avx2 level TORCHQKIT_CPU_FP32_PREFILL=panels runs them and =sgemm runs
ATen's sgemm on the same dequantized rows. Both match the reference in the kernel tests of each op; here, that the
switch reaches each op family: the two routes sum in different orders, so their results differ in the last bits."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit import kernels
from cpu_kernel_testing import assert_rel, cpu_levels, gen
from torchqkit.core import qdtypes as Q
from torchqkit.kernels.reference import linear_int4wo_tiled_ref, linear_int8wo_plain_ref

pytestmark = pytest.mark.skipif("avx2" not in cpu_levels("torchqkit::linear_int8wo_plain"),
                                reason="the C++ kernels at the avx2 level are not available here")


def _int8(n, k):
    w = torch.randn(n, k, generator=gen(0)) * 0.02
    q = qk.quantize_weight(w, Q.int8, qk.PerRow(), qk.PlainLayout(), mapping="symmetric", scale_dtype=torch.float32)
    return (lambda x: torch.ops.torchqkit.linear_int8wo_plain(x, q.qdata, q.scale, None),
            lambda x: linear_int8wo_plain_ref(x, q.qdata, q.scale, None))


def _int4(n, k):
    w = torch.randn(n, k, generator=gen(0))
    q = qk.quantize_weight(w, Q.uint4, qk.PerGroup(32), qk.TensorCoreTiledLayout(inner_k_tiles=8),
                           mapping="asymmetric", zero_point_domain="float")
    args = (q.qdata, q.scale_and_zero, 32, n, None)
    return (lambda x: torch.ops.torchqkit.linear_int4wo_tiled(x, *args), lambda x: linear_int4wo_tiled_ref(x, *args))


def _nf4(n, k):
    w = torch.randn(n, k, generator=gen(0))
    q = qk.quantize_weight(w, Q.nf4, qk.PerGroup(64), qk.NF4Layout(64), scale_dtype=torch.float32)
    args = (q.qdata, q.scale, q.scale_codes, q.scale_block_scale, q.scale_offset, 64, None)
    return lambda x: torch.ops.torchqkit.linear_nf4wo(x, *args), lambda x: x @ q.dequantize().t()


# (make, M): M at or past each op's first panel M (int8 48, int4 48; nf4 130, past the sgemm route's 128, so both routes
# dequantize rows); K past one panel k block (4096) with a tail (for int8 not a whole 8-k transpose), N not a multiple
# of 16.
CASES = {"int8": (_int8, 64), "int4": (_int4, 50), "nf4": (_nf4, 130)}


@pytest.mark.parametrize("name", list(CASES))
def test_panels_route_reaches_the_op(monkeypatch, name):
    make, m = CASES[name]
    n, k = 37, {"int8": 4100, "int4": 4224, "nf4": 4160}[name]  # whole groups (and int4 tiles of 128 k)
    op, ref = make(n, k)
    x = torch.randn(m, k, generator=gen(1))
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx2")
    out = {}
    for route in ("panels", "sgemm"):
        monkeypatch.setenv("TORCHQKIT_CPU_FP32_PREFILL", route)
        out[route] = op(x)
        assert_rel(out[route], ref(x), 1e-5, f"{name} {route}")
    assert not torch.equal(out["panels"], out["sgemm"]), f"{name}: both routes gave the same bits"


@pytest.mark.parametrize("route, says", [("panels", "this project's fp32 panels"),
                                         ("sgemm", "ATen's sgemm on dequantized rows")])
def test_status_names_the_route(monkeypatch, route, says):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx2")
    monkeypatch.setenv("TORCHQKIT_CPU_FP32_PREFILL", route)
    for op in ("torchqkit::linear_int8wo_plain", "torchqkit::linear_int4wo_tiled", "torchqkit::linear_nf4wo"):
        assert f"float32 prefill here: {says} (TORCHQKIT_CPU_FP32_PREFILL={route})" in kernels.cpu_backend(op)[1]
    assert "float32 prefill here" not in kernels.cpu_backend("torchqkit::linear_int8da_int8_plain")[1]
