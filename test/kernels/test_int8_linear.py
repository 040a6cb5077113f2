"""torchqkit::linear_int8wo_plain and torchqkit::linear_int8da_int8_plain: opcheck, C++ kernels against the
pure-torch reference under every ISA level this CPU runs, unaligned data, layout routing, torch.compile."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit import kernels
from torchqkit.kernels.precision import float32_matmul_precision

from cpu_kernel_testing import OpLog, assert_compiled_calls_op, assert_rel, cpu_levels, gen
from cpu_kernel_testing import isa_param as isa_param_for
from cpu_kernel_testing import needs_kernel, running_level, unaligned
from torchqkit.core import qdtypes as Q
from torchqkit.kernels.reference import linear_int8da_int8_plain_ref, linear_int8wo_plain_ref

WO = torch.ops.torchqkit.linear_int8wo_plain
DA = torch.ops.torchqkit.linear_int8da_int8_plain
LEVELS = cpu_levels("torchqkit::linear_int8wo_plain")
needs_ext = needs_kernel(LEVELS)
isa_param = isa_param_for(LEVELS)
# The weight-only op also has AVX512-BF16 kernels (Note [int8 weight-only in bf16] in csrc/cpu/linear_int8.cpp).
WO_LEVELS = cpu_levels("torchqkit::linear_int8wo_plain", with_avx512_bf16=True)
# The dynamic-activation op also has AMX-INT8 panels (Note [int8 panels on AMX] in csrc/cpu/amx_int8_gemm.h; tested
# in test_amx_panels.py) and 256-bit vpdpbusd panels at the avx_vnni level (Note [int8 x int8 prefill on AVX-VNNI]).
DA_LEVELS = cpu_levels("torchqkit::linear_int8da_int8_plain", with_amx=True)
DA_KERNEL_LEVELS = cpu_levels("torchqkit::linear_int8da_int8_plain", with_avx_vnni=True)



def _weight(n, k, groups, seed=0):
    g = gen(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, groups, generator=g) * 0.02 + 0.001, torch.randn(n, generator=g)


def _act(m, k, dtype, seed=1):
    return (torch.randn(m, k, generator=gen(seed)) * 3).to(dtype)



# Kernel vs reference on the same codes: both accumulate in float32 (the dynamic op in exact int32), so
# they differ only by summation order (fp32: ~K * 2^-24 relative, budget 1e-5) or, for half outputs, by
# one rounding of nearly equal fp32 values to the output dtype (one ulp: 2^-8 bf16, 2^-11 fp16).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (M, K, N, groups): M = 1, 3, 17 (odd; 17 also takes the panel path), 40 (panel path, M % 6 tile != 0);
# K = 1 (smallest legal for per-channel), 16 (smallest group-of-16), K not a multiple of any SIMD width,
# K > one k-block (256 fp32 / 1024 int8) with a tail; N = 1 and N not a multiple of 16 / 32. One token takes
# tiles of 8 rows on AVX-512 (Note [decode rows in flight]): N = 37 / 29 end on a partial one, per channel and
# grouped.
WO_CASES = [
    (1, 1, 1, 1), (3, 1, 37, 1), (1, 100, 37, 1), (1, 96, 29, 6), (3, 100, 47, 4), (17, 16, 33, 1), (17, 96, 65, 12),
    (17, 96, 65, 6), (40, 300, 97, 1), (40, 512, 70, 16), (1, 1030, 37, 1), (8, 520, 129, 65),
    (17, 1100, 33, 1), (17, 1088, 33, 17),  # the AVX-512 fp32 panel's k block (1024) and a tail, per channel / g64
    (50, 300, 97, 1), (257, 96, 65, 6),  # from M = 48 (AVX-512: on Intel) dequantized rows + ATen's sgemm
    (64, 1100, 37, 1),  # both float32 prefill routes past the panel's k block
]
# The AVX512-BF16 prefill (M >= 16; groups of whole 32-k steps or one per row): N odd and past one 32-row panel
# (a partial panel), K past one 256-k panel block with a tail step (K = 300, 1100), M = 17 / 255 (a last 6-row
# tile of 5 / 3 tokens), groups 32 / 64 / 512 (a segment is part of a group); groups of 12 k stay on the fp32
# kernels. Under every level (the others run their fp32 kernels on the same calls).
WO_BF16_CASES = [(17, 300, 33, 1), (255, 1100, 37, 1), (17, 1088, 65, 17), (24, 512, 31, 16), (40, 1024, 9, 2),
                 (17, 96, 33, 8)]


# bf16 activations: the products of bf16 x and exact bf16 codes are exact and summed in fp32, as the reference's;
# only the order and the output's rounding differ: TOL[bfloat16].
@needs_ext
@isa_param_for(WO_LEVELS)
@pytest.mark.parametrize("case", WO_BF16_CASES, ids=str)
def test_weight_only_bf16_prefill_matches_reference(monkeypatch, isa, case):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    m, k, n, groups = case
    q, s, b = _weight(n, k, groups)
    x, b = _act(m, k, torch.bfloat16), b.bfloat16()
    assert_rel(WO(x, q, s, b), linear_int8wo_plain_ref(x, q, s, b), TOL[torch.bfloat16], f"{isa} {case}")


# float32 activations under torch.set_float32_matmul_precision("medium") take the bf16 prefill on AVX512-BF16: the
# result is then the reference on x rounded to bf16 (exact products, fp32 sums: fp32 summation-order budget), and
# differs from the exact fp32 result by far more than that budget; "highest" (the default) keeps it exact.
# Decode M (below 16) stays on the fp32 kernels either way. The status string says which path fp32 takes.
@needs_ext
@pytest.mark.skipif("avx512_bf16" not in WO_LEVELS, reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("m", [3, 17, 255])
def test_float32_activations_take_bf16_under_medium_precision(monkeypatch, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx512_bf16")  # whatever level the session forces
    q, s, b = _weight(45, 544, 17)
    x = _act(m, 544, torch.float32)
    exact, rounded = linear_int8wo_plain_ref(x, q, s, b), linear_int8wo_plain_ref(x.bfloat16().float(), q, s, b)
    op = "torchqkit::linear_int8wo_plain"
    assert "float32 activations: the fp32 kernels" in kernels.cpu_backend(op)[1]
    with float32_matmul_precision("medium"):
        assert "M >= 16 in the bf16 kernels" in kernels.cpu_backend(op)[1]
        out = WO(x, q, s, b)
    assert torch.get_float32_matmul_precision() == "highest"
    assert_rel(out, rounded if m >= 16 else exact, TOL[torch.float32], f"medium, M = {m}")
    if m >= 16:
        assert (out - exact).abs().max() > 100 * TOL[torch.float32] * exact.abs().max()
    assert_rel(WO(x, q, s, b), exact, TOL[torch.float32], f"highest, M = {m}")


# DA: M = 257 with K = 1031 has a last micro-tile of 5 tokens and an odd k tail (Note [AVX2 int8 prefill]);
# N = 21 leaves a partial panel of 16; K = 4200 crosses both panel paths' k block (4096) with a tail.
DA_CASES = [(1, 1, 1), (3, 1, 37), (1, 100, 37), (1, 130, 13), (3, 100, 47), (17, 64, 33), (17, 1030, 65), (40, 300, 97),
            (8, 2100, 40), (257, 1031, 21), (20, 4200, 21)]


@needs_ext
@isa_param_for(WO_LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WO_CASES, ids=str)
def test_weight_only_matches_reference(monkeypatch, isa, dtype, case):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    m, k, n, groups = case
    q, s, b = _weight(n, k, groups)
    x = _act(m, k, dtype)
    # From M = 48 each float32 prefill route (Note [fp32 prefill by sgemm]; the AVX-512 levels pick one by vendor)
    for route in ("sgemm", "panels") if m >= 48 else ("",):
        monkeypatch.setenv("TORCHQKIT_CPU_FP32_PREFILL", route)
        what = f"{isa} {case} {route}"
        assert_rel(WO(x, q, s, b.to(dtype)), linear_int8wo_plain_ref(x, q, s, b.to(dtype)), TOL[dtype], what)
        assert_rel(WO(x, q, s, None), linear_int8wo_plain_ref(x, q, s, None), TOL[dtype], f"{what} no bias")


@needs_ext
@isa_param_for(DA_KERNEL_LEVELS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DA_CASES, ids=str)
def test_dynamic_int8_matches_reference(monkeypatch, isa, symmetric, dtype, case):
    # Activation codes are identical (same fp32 division and round-half-even), so only the epilogue differs.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    m, k, n = case
    q, s, b = _weight(n, k, 1)
    x = _act(m, k, dtype)
    if not symmetric:
        x = x + 1.5  # a skewed range, so the zero point is far from the middle
    out, ref = DA(x, q, s, b, symmetric), linear_int8da_int8_plain_ref(x, q, s, b, symmetric)
    assert_rel(out, ref, TOL[dtype], f"{isa} {case}")


@pytest.mark.skipif("avx_vnni" not in DA_KERNEL_LEVELS, reason="the CPU runs no AVX-VNNI (VEX or AVX-512 VNNI's EVEX ymm form)")
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("case", [c for c in DA_CASES if c[0] >= 16], ids=str)
def test_dynamic_int8_avx_vnni_prefill_equals_avx2(monkeypatch, symmetric, case):
    # Both prefills sum a q exactly in int32 (vpdpbusd on int8 panels / vpmaddwd on int16 ones) and share the epilogue,
    # so the outputs are equal bit for bit, not only within the reference's tolerance.
    m, k, n = case
    q, s, b = _weight(n, k, 1)
    x = _act(m, k, torch.float32) + (0.0 if symmetric else 1.5)
    out = {}
    for level in ("avx2", "avx_vnni"):
        monkeypatch.setenv("TORCHQKIT_CPU_ISA", level)
        out[level] = DA(x, q, s, b, symmetric)
    torch.testing.assert_close(out["avx_vnni"], out["avx2"], rtol=0, atol=0)


@needs_ext
@isa_param
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_activation_codes_exact_with_ties_and_non_finite_rows(monkeypatch, isa, symmetric):
    # An identity weight with scale 1 makes each output row the dequantized activation row, so every code
    # the kernel's quantizer makes is compared exactly with the oracle's. Row 0 has amax 127.5 (scale 1):
    # its x.5 values are round-half-even ties. A NaN row and an Inf row give NaN rows and touch no other.
    # K = 37 leaves a partial vector at every width (8, 16) in the scan and in the code pass.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    k = 37
    ties = torch.arange(k, dtype=torch.float32) - 18.5
    ties[0], ties[-1] = -127.5, 126.5
    x = torch.stack([ties, torch.randn(k, generator=gen(3)) * 4 + 1.0, torch.randn(k, generator=gen(4)),
                     torch.randn(k, generator=gen(5))])
    x[2, 5], x[3, 36] = float("nan"), float("inf")
    eye, ones = torch.eye(k, dtype=torch.int8), torch.ones(k)
    out, ref = DA(x, eye, ones, None, symmetric), linear_int8da_int8_plain_ref(x, eye, ones, None, symmetric)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True, msg=f"{isa} symmetric={symmetric}")
    assert out[2:].isnan().all() and not out[:2].isnan().any()
    if symmetric:  # scale 1, zero point 0: the codes themselves, torch.round being half to even as well
        assert torch.equal(out[0], ties.round())


@needs_ext
@isa_param
def test_constant_and_zero_rows(monkeypatch, isa):
    # Zero rows take scale 1 (never inf / nan); constant rows exercise the asymmetric zero point clamp.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    q, s, b = _weight(19, 70, 1)
    x = torch.stack([torch.zeros(70), torch.full((70,), 2.5), torch.full((70,), -1.0), torch.randn(70)])
    for sym in (True, False):
        assert_rel(DA(x, q, s, b, sym), linear_int8da_int8_plain_ref(x, q, s, b, sym), 1e-5, f"sym={sym}")



@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 40])
def test_unaligned_inputs(monkeypatch, isa, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    q, s, b = _weight(37, 300, 1)
    x = _act(m, 300, torch.float32)
    qu, xu, su = unaligned(q, 1), unaligned(x, 4), unaligned(s, 4)
    assert qu.data_ptr() % 16 == 1 and xu.data_ptr() % 16 == 4
    assert_rel(WO(xu, qu, su, b), linear_int8wo_plain_ref(x, q, s, b), 1e-5, "weight-only")
    assert_rel(DA(xu, qu, su, b, True), linear_int8da_int8_plain_ref(x, q, s, b, True), 1e-5, "dynamic int8")


@needs_ext
def test_row_strided_weight_view():
    # A narrowed (N, K) view keeps its row stride; the kernel reads it in place.
    q, s, b = _weight(40, 128, 1)
    view = q[:, 32:96]
    x = _act(5, 64, torch.float32)
    assert_rel(WO(x, view, s, b), linear_int8wo_plain_ref(x, view.contiguous(), s, b), 1e-5)
    assert_rel(DA(x, view, s, b, False), linear_int8da_int8_plain_ref(x, view.contiguous(), s, b, False), 1e-5)


def test_empty_batch():
    q, s, b = _weight(8, 32, 1)
    x = torch.empty(0, 32)
    assert WO(x, q, s, b).shape == (0, 8) and DA(x, q, s, b, True).shape == (0, 8)


@pytest.mark.parametrize("op,extra", [(WO, ()), (DA, (True,)), (DA, (False,))], ids=["wo", "da_sym", "da_asym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(op, extra, dtype):
    q, s, b = _weight(24, 64, 1 if op is DA else 4)
    x = _act(3, 64, dtype).reshape(1, 3, 64)
    torch.library.opcheck(op, (x, q, s, b.to(dtype), *extra))
    torch.library.opcheck(op, (x.requires_grad_(), q, s, None, *extra))


@needs_ext
@pytest.mark.parametrize("op", ["torchqkit::linear_int8wo_plain", "torchqkit::linear_int8da_int8_plain"])
def test_cpu_kernel_registered_and_reported(monkeypatch, op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeExplicitAutograd")
    levels = WO_LEVELS if op.endswith("int8wo_plain") else DA_LEVELS
    assert kernels.cpu_backend(op)[0] == f"cpp {running_level(levels)}"
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "scalar")
    path, why = kernels.cpu_backend(op)
    assert path == "cpp scalar" and "TORCHQKIT_CPU_ISA=scalar" in why
    rows = [r for r in kernels.status() if r["linear"] == op]
    assert rows == [{"layout": "(op)", "linear": op, "path": "cpp scalar", "why": why}]


@needs_ext
def test_bad_fp32_prefill_route_is_an_error(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_FP32_PREFILL", "mkl")
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx512_vnni" if "avx512_vnni" in WO_LEVELS else "avx2")
    q, s, b = _weight(8, 32, 1)
    x = _act(64, 32, torch.float32)
    # the route is read where both routes can serve: the prefill at the AVX-512 and AVX2 levels
    with pytest.raises(RuntimeError, match="TORCHQKIT_CPU_FP32_PREFILL=mkl is not one of panels, sgemm"):
        WO(x, q, s, b)
    assert_rel(WO(x[:8], q, s, b), linear_int8wo_plain_ref(x[:8], q, s, b), TOL[torch.float32])  # the dot kernel


def test_bad_isa_request_is_an_error(monkeypatch):
    q, s, b = _weight(8, 32, 1)
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx9000")
    with pytest.raises(RuntimeError, match="not one of amx, avx512_bf16, avx512_vnni, avx_vnni, avx2, scalar"):
        WO(torch.randn(2, 32), q, s, b)


def test_without_extension_status_names_reference_and_ops_still_run():
    code = (
        "import torch, torchqkit as qk\n"
        "rows = [r for r in qk.kernels.status() if r['layout'] == '(op)']\n"
        "assert rows and all(r['path'] == 'reference' and 'TORCHQKIT_DISABLE_CPU_EXTENSION' in r['why'] for r in rows)\n"
        "q = torch.randint(-128, 128, (8, 32), dtype=torch.int8)\n"
        "out = torch.ops.torchqkit.linear_int8wo_plain(torch.randn(2, 32), q, torch.ones(8, 1), None)\n"
        "assert out.shape == (2, 8)\n"
    )
    env = {**os.environ, "TORCHQKIT_DISABLE_CPU_EXTENSION": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


# ------------------------------------------------------------------------------------------------
# Through the plain layout
# ------------------------------------------------------------------------------------------------

def _int8_weight(dtype=torch.float32, granularity=None, act=None, pref="auto"):
    w = torch.randn(37, 96, generator=gen(3)).to(dtype)
    return qk.quantize_weight(w, Q.int8, granularity or qk.PerRow(), qk.PlainLayout(), act_quant=act,
                              kernel_preference=pref)


ACT_SYM = qk.ActivationQuantSpec(Q.int8, qk.PerToken())
ACT_ASYM = qk.ActivationQuantSpec(Q.int8, qk.PerToken(), "asymmetric")


@pytest.mark.parametrize("granularity,act,op", [
    (qk.PerRow(), None, "linear_int8wo_plain"), (qk.PerGroup(32), None, "linear_int8wo_plain"),
    (qk.PerRow(), ACT_SYM, "linear_int8da_int8_plain"), (qk.PerRow(), ACT_ASYM, "linear_int8da_int8_plain"),
], ids=["wo_row", "wo_g32", "da_sym", "da_asym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layout_linear_uses_op_and_matches_dequantized(granularity, act, op, dtype):
    aqt = _int8_weight(dtype, granularity, act)
    ref_w = _int8_weight(dtype, granularity, act, pref="reference")
    x = _act(5, 96, dtype)
    log = OpLog()
    with log:
        out = F.linear(x, aqt)
    assert log.ops == [op]
    ref = F.linear(x, ref_w)  # = F.linear(fake_quant(x), w.dequantize()) in x's dtype
    # fp32: summation order only. bf16: the reference rounds the dequantized weight (and, with dynamic
    # activations, its own activation scale and fake-quantized values) to bf16 before its matmul; the op
    # computes in fp32 and rounds once, so the budget is a few bf16 ulps of the output's magnitude.
    assert_rel(out, ref, 1e-5 if dtype == torch.float32 else 2.0 ** -5, op)


def test_reference_preference_keeps_the_reference():
    aqt = _int8_weight(pref="reference")
    log = OpLog()
    with log:
        F.linear(_act(2, 96, torch.float32), aqt)
    assert "linear_int8wo_plain" not in log.ops and ("mm" in log.ops or "addmm" in log.ops)


def test_float64_activations_use_the_reference():
    aqt = _int8_weight(torch.float64)
    x = _act(2, 96, torch.float64)
    log = OpLog()
    with log:
        out = F.linear(x, aqt)
    assert "linear_int8wo_plain" not in log.ops
    torch.testing.assert_close(out, F.linear(x, aqt.dequantize()))


@pytest.mark.parametrize("act,op", [(None, "linear_int8wo_plain"), (ACT_ASYM, "linear_int8da_int8_plain")],
                         ids=["wo", "da"])
def test_compile_fullgraph_calls_the_custom_op(act, op):
    lin = torch.nn.Linear(96, 37)
    lin.weight = torch.nn.Parameter(_int8_weight(act=act), requires_grad=False)
    assert_compiled_calls_op(lin, _act(4, 96, torch.float32), op)


def test_input_gradient_flows_through_the_dequantized_weight():
    aqt = _int8_weight()
    x = _act(3, 96, torch.float32).requires_grad_()
    F.linear(x, aqt).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 37) @ aqt.dequantize(), rtol=1e-5, atol=1e-5)
