"""The amx level (csrc/cpu/amx_bf16_gemm.h): the weight-only prefill's bf16 panels on AMX tiles, and float32
activations as three exact bf16 planes there. Against the avx512_bf16 level's vdpbf16ps kernels on the same bytes
(bf16 activations) and against its fp32 kernels (float32 activations: the planes keep fp32 precision), on token
counts that leave partial 16- and 32-row blocks, weights with partial 32-row panels and more panels than one group
(Note [AMX panel blocking]); and next to torch's own AMX matmuls (oneDNN loads its own tile configuration in the
same thread)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit import kernels
from torchqkit.core import qdtypes as Q

from cpu_kernel_testing import assert_rel, cpu_levels, gen

LEVELS = cpu_levels("torchqkit::linear_nf4wo", with_avx512_bf16=True)
pytestmark = pytest.mark.skipif("amx" not in LEVELS, reason="the CPU (or its OS) does not run AMX-BF16 tiles")

# K: ten 32-k steps (not a whole 256-k panel block); N: two full 32-row panels and 8 rows (50 rows: a pair of panels
# whose right one is partial, as the float32 planes run them; 300 rows: a group of 8 panels, then a full and a
# partial one)
K, N = 320, 72


def _w(n=N, k=K):
    return torch.randn(n, k, generator=gen(0)) * 0.05


# name -> quantized weight whose F.linear routes to a bf16-panel kernel
WEIGHTS = {
    "int8 per row": lambda: qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout(), mapping="symmetric",
                                               scale_dtype=torch.float32),
    "int8 per row, 50 rows": lambda: qk.quantize_weight(_w(50, K), Q.int8, qk.PerRow(), qk.PlainLayout(),
                                                        mapping="symmetric", scale_dtype=torch.float32),
    "int8 per row, 300 rows": lambda: qk.quantize_weight(_w(300, K), Q.int8, qk.PerRow(), qk.PlainLayout(),
                                                         mapping="symmetric", scale_dtype=torch.float32),
    "int8 g64": lambda: qk.quantize_weight(_w(), Q.int8, qk.PerGroup(64), qk.PlainLayout(), mapping="symmetric",
                                           scale_dtype=torch.float32),
    "int4 tiled g32": lambda: qk.quantize_weight(_w().bfloat16(), Q.uint4, qk.PerGroup(32),
                                                 qk.TensorCoreTiledLayout(inner_k_tiles=2), mapping="asymmetric",
                                                 zero_point_domain="float"),
    "int4 tiled g64": lambda: qk.quantize_weight(_w(72, 512).bfloat16(), Q.uint4, qk.PerGroup(64),
                                                 qk.TensorCoreTiledLayout(inner_k_tiles=8), mapping="asymmetric",
                                                 zero_point_domain="float"),
    "fp8 per row": lambda: qk.quantize_weight(_w(), Q.float8_e4m3fn, qk.PerRow(), qk.Float8Layout(),
                                              scale_dtype=torch.float32),
    "int3 g32 zero points": lambda: qk.quantize_weight(_w(), Q.uint3, qk.PerGroup(32), qk.PackedIntxLayout(),
                                                       mapping="asymmetric"),
    "nf4 b64": lambda: qk.quantize_weight(_w(), Q.nf4, qk.PerGroup(64), qk.NF4Layout(64, False),
                                          scale_dtype=torch.float32),
}
MS = [16, 17, 40, 65]  # one A tile short, a block of 16 + 1, 32 + 8, two blocks + 1


def _at(level, monkeypatch, fn):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", level)
    return fn()


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("m", MS)
def test_bf16_activations_match_the_vdpbf16ps_kernels(name, m, monkeypatch):
    w = WEIGHTS[name]()
    x = (torch.randn(m, w.shape[1], generator=gen(1)) * 3).bfloat16()
    ref = _at("avx512_bf16", monkeypatch, lambda: F.linear(x, w))
    out = _at("amx", monkeypatch, lambda: F.linear(x, w))
    # the same exact products summed in fp32 in another order, then one bf16 rounding each: at most 1 output ulp
    assert_rel(out, ref, 2.0 ** -8, f"{name}, M = {m}")


@pytest.mark.parametrize("name", [n for n in WEIGHTS if not n.startswith("nf4")])
@pytest.mark.parametrize("m", MS)
def test_float32_activations_keep_fp32_precision(name, m, monkeypatch):
    w = WEIGHTS[name]()
    x = torch.randn(m, w.shape[1], generator=gen(2)) * 3
    # the fp32 kernels compute the weights' exact float32 values (dequantize() would round int4's to its bf16 scales)
    ref = _at("avx512_bf16", monkeypatch, lambda: F.linear(x, w))
    out = _at("amx", monkeypatch, lambda: F.linear(x, w))
    assert out.dtype == torch.float32
    # one bf16 plane would be ~2^-9 of max |y| off; three are exact, leaving fp32 sums in another order (~1e-6)
    assert_rel(out, ref, 1e-5, f"{name}, M = {m}")


def test_float32_planes_beat_one_bf16_plane_by_orders_of_magnitude(monkeypatch):
    """The planes are what runs: under 'medium' fp32 precision (one bf16 plane allowed) the error is the bf16 one."""
    w = WEIGHTS["int8 per row"]()
    x = torch.randn(40, K, generator=gen(3)) * 3
    ref = F.linear(x.double(), w.dequantize().double())  # int8 codes x float32 scales: exact in float64
    planes = _at("amx", monkeypatch, lambda: F.linear(x, w))
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        one = F.linear(x, w)
    finally:
        torch.set_float32_matmul_precision(prev)
    err = lambda y: ((y.double() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    assert err(one) > 1e-4 and err(planes) < 1e-5, (err(one), err(planes))


def test_torch_amx_matmuls_between_calls_leave_results_unchanged(monkeypatch):
    """oneDNN's bf16 matmul loads its own tile configuration in this thread; each panel_gemm call loads ours."""
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "amx")
    w = WEIGHTS["int4 tiled g32"]()
    x = (torch.randn(40, K, generator=gen(4))).bfloat16()
    first = F.linear(x, w)
    a, b = torch.randn(64, 256).bfloat16(), torch.randn(256, 96).bfloat16()
    for _ in range(3):
        torch.mm(a, b)
        assert torch.equal(F.linear(x, w), first)


def test_status_names_the_amx_level(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "amx")
    backend, why = kernels.cpu_backend("torchqkit::linear_int8wo_plain")
    assert backend == "cpp amx" and "AMX tiles" in why and "three bf16 planes" in why
    backend, why = kernels.cpu_backend("torchqkit::linear_int8da_int8_plain")
    assert backend == "cpp amx" and "AMX-INT8" in why
    backend, why = kernels.cpu_backend("torchqkit::sdpa_over_filled_cache")  # no AMX or bf16 kernel: AVX-512
    assert backend == "cpp avx512_vnni" and "amx level" in why


def _dyn_int4(n, k, gran):
    act = qk.ActivationQuantSpec(Q.int8, qk.PerToken(), "asymmetric")
    return qk.quantize_weight(_w(n, k), Q.int4, gran, qk.PackedIntxLayout(), mapping="symmetric", act_quant=act)


DYNAMIC = {  # int8 dynamic activations: AMX-INT8 tiles (Note [int8 panels on AMX]); g32 blocks stay on vpdpbusd
    "x int8 per row": lambda: qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout(), mapping="symmetric",
                                                 act_quant=qk.ActivationQuantSpec(Q.int8, qk.PerToken(), "asymmetric"),
                                                 scale_dtype=torch.float32),
    "x int4 g128": lambda: _dyn_int4(N, 512, qk.PerGroup(128)),
    "x int4 g64": lambda: _dyn_int4(N, K, qk.PerGroup(64)),
    "x int4 per row": lambda: _dyn_int4(50, 384, qk.PerRow()),
    "x int4 g32": lambda: _dyn_int4(N, K, qk.PerGroup(32)),
}


@pytest.mark.parametrize("name", list(DYNAMIC))
@pytest.mark.parametrize("m", MS)
def test_int8_dynamic_activations_give_the_vnni_kernels_result_bit_for_bit(name, m, monkeypatch):
    """Exact int32 sums either way, then the same epilogue: equal floats."""
    w = DYNAMIC[name]()
    x = torch.randn(m, w.shape[1], generator=gen(5)) * 3
    bias = torch.randn(w.shape[0], generator=gen(6))
    ref = _at("avx512_bf16", monkeypatch, lambda: F.linear(x, w, bias))
    out = _at("amx", monkeypatch, lambda: F.linear(x, w, bias))
    assert torch.equal(out, ref), (out - ref).abs().max()


def test_float32_planes_split_values_of_every_magnitude_exactly(monkeypatch):
    """Rows of very different scales (1e-20 .. 1e20), negative values, zeros and a k tail inside a 16-lane step:
    each row's result within fp32 rounding of that row's own size, as the fp32 kernels give it."""
    w = qk.quantize_weight(_w(40, 100), Q.int8, qk.PerRow(), qk.PlainLayout(), mapping="symmetric",
                           scale_dtype=torch.float32)
    x = torch.randn(33, 100, generator=gen(7)) * torch.logspace(-20, 20, 33).unsqueeze(1)
    x[3, :50] = 0.0
    x[5] = -x[5]
    ref = _at("avx512_bf16", monkeypatch, lambda: F.linear(x, w))
    out = _at("amx", monkeypatch, lambda: F.linear(x, w))
    for m in range(33):
        assert_rel(out[m], ref[m], 1e-5, f"row {m} (|x| ~ {x[m].abs().max().item():.1e})")
