"""torchqkit::linear_int4wo_tiled on CPU (csrc/cpu/linear_int4wo_tiled.cpp): opcheck, the C++ kernel against the
pure-torch reference and against F.linear(x, w.dequantize()) under every ISA level this CPU runs, padded
and sliced tiles, unaligned data, routing from TensorCoreTiledLayout, torch.compile."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit import kernels
from torchqkit.kernels.precision import float32_matmul_precision

from cpu_kernel_testing import OpLog, assert_compiled_calls_op, assert_rel, cpu_levels, gen
from cpu_kernel_testing import isa_param as isa_param_for
from cpu_kernel_testing import needs_kernel, running_level, unaligned
from torchqkit.kernels.reference import linear_int4wo_tiled_ref

OP = torch.ops.torchqkit.linear_int4wo_tiled
# avx512_bf16 included: bf16 activations there take the vdpbf16ps decode (Note [int4 bf16 decode]) and prefill
# (Note [int4 tiled in bf16]); avx_vnni: one token on inner_k_tiles 8 or 4 may take the int16-pair decode (Note [int4
# decode on int16 pairs]), as it may at the AVX-512 levels.
LEVELS = cpu_levels("torchqkit::linear_int4wo_tiled", with_avx_vnni=True, with_avx512_bf16=True)
needs_ext = needs_kernel(LEVELS)
isa_param = isa_param_for(LEVELS)
# The int8 x int4 op also has AVX-VNNI kernels (Note [AVX-VNNI kernels] in csrc/cpu/int4_packed_vec256.inc).
DA4_LEVELS = cpu_levels("torchqkit::linear_int8da_int4_packed", with_avx_vnni=True, with_amx=True)



def _tiled(n, k, g, t, dtype=torch.float32, seed=0, pref="auto"):
    """A quantized (n, k) weight in TensorCoreTiledLayout(inner_k_tiles=t), group size g."""
    w = torch.randn(n, k, generator=gen(seed)).to(dtype)
    return qk.quantize_weight(w, qk.qdtypes.uint4, qk.PerGroup(g), qk.TensorCoreTiledLayout(inner_k_tiles=t),
                              mapping="asymmetric", zero_point_domain="float", kernel_preference=pref)


def _act(m, k, dtype, seed=1):
    return (torch.randn(m, k, generator=gen(seed)) * 2).to(dtype)


def _args(w, x, bias=None):
    return (x, w.qdata, w.scale_and_zero, w.block_size[1], w.logical_shape[0], bias)


def _assert_tokens_match_ref(w, m, dtype, what, seed=1):
    """The op on m tokens of x (with a bias) against the reference on the same bytes, token by token (a row or group
    mixed up shows as a large error in some token); returns x and the bias."""
    n, k = w.logical_shape
    x, b = _act(m, k, dtype, seed), torch.randn(n, generator=gen(2)).to(dtype)
    out, ref = OP(*_args(w, x, b)), linear_int4wo_tiled_ref(*_args(w, x, b))
    for t in range(m):
        assert_rel(out[t], ref[t], TOL[dtype], f"{what} token {t}")
    return x, b, out



# Kernel vs reference on the same bytes, both in fp32: they differ by summation order and by the kernel's
# factorization s * sum(x u) + (z - 8 s) * sum(x) (Note [int4 tiled math]), whose terms can be a few times
# the output: budget 2e-5 of max |out| (measured <= 1e-6 at K <= 1024). Half outputs: one rounding of
# nearly equal fp32 values, one ulp of the output dtype (2^-8 bf16, 2^-11 fp16) with a factor 2 margin.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (M, N, K, group, inner_k_tiles). M = 1, 3, 17 (dot kernel on AVX-512, 17 = 4 blocks of 4 + 1; below AVX-512
# the dequantize + sgemm path from M = 16, Note [int4 prefill below AVX-512]), 40 (AVX-512 prefill path from
# M = 32, 40 % 6 != 0 and 40 % 32 != 0); K = 32 with T = 2 is the smallest legal K (one chunk of
# 32 = one group); K = 320, 96, 192 are padded (Kt = 384, 128, 256); N = 1, 37 (padded n-tile), 65; groups
# per chunk 1, 2 and 4 (g = 32 with T = 8) and chunks per group > 1 (g = 256 with T = 2).
CASES = [
    (1, 1, 32, 32, 2), (3, 37, 320, 32, 8), (17, 65, 96, 32, 4), (1, 37, 192, 64, 8), (3, 8, 512, 256, 2),
    (17, 24, 384, 128, 8), (40, 37, 320, 64, 8), (40, 65, 256, 256, 4), (33, 9, 64, 32, 2),
    # M = 5, 9: an odd number of tokens after whole passes (AVX2 takes 2 per pass, AVX-512 4); M = 257: the
    # prefill paths with a 1-token tail
    (5, 13, 160, 32, 2), (9, 21, 448, 64, 4), (257, 11, 96, 32, 2),
    # the prefills at SmolLM2's K = 576 (padded to 640): 4 groups per chunk with N odd over two 32-row panels and
    # a 3-token last tile (M = 255), one group per chunk (g 128)
    (255, 45, 576, 32, 8), (64, 70, 576, 128, 8),
    # K not a multiple of 16: the decode's group sums end on a partial vector (K = 100: 4 of the last group of 32)
    (1, 37, 100, 32, 2), (3, 13, 200, 64, 4),
    # the sgemm prefill's permuted columns with K padded (Kt = 256 / 128) and groups of 64 / 32 inside a chunk
    (130, 21, 200, 64, 4), (40, 19, 100, 32, 8),
]


@needs_ext
@isa_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_reference(monkeypatch, isa, dtype, case):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    m, n, k, g, t = case
    w = _tiled(n, k, g, t, dtype)
    x, b = _act(m, k, dtype), torch.randn(n, generator=gen(2)).to(dtype)
    # every route a case can take, pinned (Note [Routes chosen by measurement]): the fp32 prefill routes (Note [fp32
    # prefill by sgemm]: AVX2 from M = 16, AVX-512 from 32) and the decode kernels of one float32 token
    pins = ([("TORCHQKIT_CPU_FP32_PREFILL", r) for r in ("sgemm", "panels")] if m >= 16 else
            [("TORCHQKIT_CPU_INT4_DECODE", r) for r in ("float", "int16", "bf16")] if m == 1 else [("", "")])
    for variable, route in pins:
        if variable:
            monkeypatch.setenv(variable, route)
        what = f"{isa} {case} {route}"
        assert_rel(OP(*_args(w, x, b)), linear_int4wo_tiled_ref(*_args(w, x, b)), TOL[dtype], what)
        assert_rel(OP(*_args(w, x)), linear_int4wo_tiled_ref(*_args(w, x)), TOL[dtype], f"{what} no bias")


def _avx_vnni_builds() -> list[str]:
    """The builds of the AVX-VNNI kernels this CPU runs (Note [AVX-VNNI kernels]: VEX where it has AVX-VNNI, EVEX where
    it has AVX-512 VNNI; TORCHQKIT_CPU_AVX_VNNI picks one), asked of the extension: a build it lacks raises."""
    if "avx_vnni" not in LEVELS:
        return []
    w, x, builds = _tiled(8, 128, 128, 8), torch.zeros(1, 128), []
    saved = {v: os.environ.get(v) for v in ("TORCHQKIT_CPU_ISA", "TORCHQKIT_CPU_AVX_VNNI")}
    try:
        os.environ["TORCHQKIT_CPU_ISA"] = "avx_vnni"
        for build in ("vex", "evex"):
            os.environ["TORCHQKIT_CPU_AVX_VNNI"] = build
            try:
                OP(*_args(w, x))
                builds.append(build)
            except RuntimeError:
                pass
    finally:
        for v, val in saved.items():
            if val is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = val
    return builds


VNNI_BUILDS = _avx_vnni_builds()


@pytest.mark.skipif("avx_vnni" not in LEVELS, reason="no AVX-VNNI level on this CPU")
@pytest.mark.parametrize("build", VNNI_BUILDS or ["none"])
@pytest.mark.parametrize("t", [8, 4])
@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("level", [lv for lv in ("avx_vnni", "avx512_vnni") if lv in LEVELS])
def test_int16_pair_decode_is_float32_accurate(monkeypatch, level, build, t, g):
    """AVX-VNNI and AVX-512 levels, M = 1, inner_k_tiles 8 / 4, the int16-pair route pinned (Note [int4 decode on int16
    pairs]): activations spanning 60 orders of two within one call (a chunk of 1e-12 next to one of 1e6, one outlier
    1e4 times its chunk) match the float32 kernel of the AVX2 level to float32 rounding; a chunk below 2^-98, an Inf
    and a NaN take the float32 kernel (the same result as AVX2, NaN / Inf included)."""
    n, k = 37, 1024
    w = _tiled(n, k, g, t)
    x = _act(1, k, torch.float32)
    x[0, :128] *= 1e-12
    x[0, 128:256] *= 1e6
    x[0, 300] *= 1e4
    cases = {"wide range": x, "tiny chunk": x.clone(), "inf": x.clone(), "nan": x.clone()}
    cases["tiny chunk"][0, 512:640] = 1e-31
    cases["inf"][0, 700] = float("inf")
    cases["nan"][0, 5] = float("nan")
    monkeypatch.setenv("TORCHQKIT_CPU_AVX_VNNI", build)
    monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", "int16")  # the AVX2 level has no such route: its float32 kernel
    for what, xx in cases.items():
        monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx2")
        want = OP(*_args(w, xx))
        monkeypatch.setenv("TORCHQKIT_CPU_ISA", level)
        got = OP(*_args(w, xx))
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), what
        fin = want.isfinite()
        if fin.any():
            err = ((got - want)[fin].abs().max() / want[fin].abs().max()).item()
            assert err < 2e-6, f"{what}: {err:.2e} of max |out| off the float32 kernel"
            assert_rel(got[fin], linear_int4wo_tiled_ref(*_args(w, xx))[fin], TOL[torch.float32], what)


@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 3, 40])
def test_kernel_matches_dequantized_linear(monkeypatch, isa, m):
    # docs/architecture.md's check: F.linear(x, w.dequantize()). A float32 weight dequantizes in fp32, so only the
    # summation order differs (budget as TOL[float32]).
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _tiled(37, 320, 64, 8)
    x = _act(m, 320, torch.float32)
    assert_rel(OP(*_args(w, x)), F.linear(x, w.dequantize()), 2e-5, f"{isa} m={m}")



# float32 activations under torch.set_float32_matmul_precision("medium") take the bf16 kernels on AVX512-BF16: the
# prefill from M = 32, the decode kernel at inner_k_tiles 8 and 4 (Note [int4 bf16 decode]). The result is the reference
# on x rounded to bf16 (exact products, fp32 sums and the zero term in fp32: the fp32 budget), far from the exact
# fp32 result; "highest" (the default), and decode M at other tilings, stay exact.
@needs_ext
@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("m, t", [(1, 8), (5, 8), (5, 4), (5, 2), (40, 4)])
def test_float32_activations_take_bf16_under_medium_precision(monkeypatch, m, t):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx512_bf16")  # whatever level the session forces
    monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", "bf16")  # one token may measure another kernel faster
    w = _tiled(37, 320, 64, t)
    x, b = _act(m, 320, torch.float32), torch.randn(37, generator=gen(2))
    exact = linear_int4wo_tiled_ref(*_args(w, x, b))
    rounded = linear_int4wo_tiled_ref(*_args(w, x.bfloat16().float(), b))
    op = "torchqkit::linear_int4wo_tiled"
    with float32_matmul_precision("medium"):
        why = kernels.cpu_backend(op)[1]
        assert "every M (M >= 32 at inner_k_tiles 2; one token: the kernel measured fastest" in why
        assert "in the bf16 kernels" in why
        out = OP(*_args(w, x, b))
    bf16 = m >= 32 or t in (8, 4)
    assert_rel(out, rounded if bf16 else exact, TOL[torch.float32], f"medium, M = {m}, inner_k_tiles {t}")
    if bf16:
        assert (out - exact).abs().max() > 10 * TOL[torch.float32] * exact.abs().max()
    assert "float32 activations: the fp32 kernels" in kernels.cpu_backend(op)[1]
    assert_rel(OP(*_args(w, x, b)), exact, TOL[torch.float32], f"highest, M = {m}")


# Group 32 at inner_k_tiles 8 (4 groups per chunk) has its own lane-scale route in the decode kernel (Note [g = 32
# lane scales] in csrc/cpu/linear_int4wo_tiled.cpp), and its scale prefetch runs across n-tiles when K is short.
# SmolLM2's K = 576 (5 chunks, the last one half padding); 72 rows = 9 n-tiles; M = 1 and 5 (a partial pass after 4 or 2
# tokens); every scale dtype. Each token's output is compared, so a row or group mixed up shows as a large error.
@needs_ext
@isa_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5])
def test_group32_decode_at_smollm2_width(monkeypatch, isa, dtype, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _tiled(72, 576, 32, 8, dtype)
    assert w.scale_and_zero.shape == (20, 72, 2) and w.qdata.shape == (9, 5, 32, 4)
    x, b, out = _assert_tokens_match_ref(w, m, dtype, f"{isa} {dtype}")
    if dtype == torch.float32:
        assert_rel(out - b, F.linear(x, w.dequantize()), 2e-5, f"{isa} against the dequantized weight")


# inner_k_tiles 4 at SmolLM2's K = 576 (9 chunks of 64, no padding): each vector of a chunk holds two rows, which the
# bf16 decode kernel sums half by half; g = 32 is two groups per chunk, g = 64 one, g = 128 one per two chunks (K
# padded to 640), g = 256 one per four (768). M = 1, 2 and 5, every activation dtype (bf16 takes that kernel on
# AVX512-BF16, the others the fp32 one).
@needs_ext
@isa_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_inner_k_tiles_4_decode_at_smollm2_width(monkeypatch, isa, dtype, g, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _tiled(72, 576, g, 4, dtype)
    assert w.qdata.shape == (9, -(-576 // g) * g // 64, 32, 2)
    _assert_tokens_match_ref(w, m, dtype, f"{isa} {dtype} g={g}")


# One group per chunk at inner_k_tiles 8 (g = 128, 256) broadcasts each row's scale from the stored float32
# scale_and_zero, or from a float32 copy of a bfloat16 / float16 one (Vec::chunk_scales in
# csrc/cpu/linear_int4wo_tiled.cpp); every nibble but the first reaches the decoder pre-multiplied into x (Note [int4
# nibble decode]). SmolLM2's K = 576 padded to 640 (g = 256: 768), 72 rows = 9 n-tiles (more than one work item per
# thread), M = 1 and 5, every scale dtype.
@needs_ext
@isa_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [128, 256])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_one_group_per_chunk_decode_at_smollm2_width(monkeypatch, isa, dtype, g, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _tiled(72, 576, g, 8, dtype)
    assert w.qdata.shape == (9, -(-576 // g) * g // 128, 32, 4) and w.scale_and_zero.dtype == dtype  # K 640 / 768
    _assert_tokens_match_ref(w, m, dtype, f"{isa} {dtype} g={g}")


# From 8 groups on the decode runs in blocks of n-tiles whose scales are copied to a buffer (Note [scales staged per
# block] in csrc/cpu/linear_int4wo_tiled.cpp): K = 2048 at g = 32 is 64 groups, blocks of 32 n-tiles with bf16 / fp16
# scales and 16 with float32 ones; K = 1024 at g = 128 is 8 groups, blocks of 64 n-tiles (the most a block takes). 1292
# rows = 162 n-tiles (the last one half empty): several blocks a thread, a thread's first block on the stored scales, a
# last block cut short, on one thread and on two. M = 1 and 3, every activation dtype and both tilings; each token
# against the reference.
@needs_ext
@isa_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [8, 4])
@pytest.mark.parametrize("k,g", [(2048, 32), (1024, 128)])
def test_decode_in_scale_blocks(monkeypatch, isa, dtype, t, k, g):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _tiled(1292, k, g, t, dtype)
    assert w.scale_and_zero.shape == (k // g, 1296, 2)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for m in (1, 3):
                _assert_tokens_match_ref(w, m, dtype, f"{isa} {dtype} T={t} threads={nt}", seed=m)
    finally:
        torch.set_num_threads(threads)


# The glue reads a float32 contiguous x in place and makes out in x's leading shape; any other x is copied first.
# Its scratch for the permuted activation is per thread and only grows: calls of different sizes in a row, on one
# thread and on two, must not see each other's data.
@needs_ext
@isa_param
def test_input_forms_and_reused_scratch(monkeypatch, isa):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w_big, w_small = _tiled(72, 576, 128, 8), _tiled(37, 192, 64, 4)
    x = _act(6, 576, torch.float32)
    ref = linear_int4wo_tiled_ref(*_args(w_big, x))
    out3d = OP(*_args(w_big, x.reshape(2, 3, 576)))
    assert out3d.shape == (2, 3, 72) and out3d.dtype == torch.float32
    assert_rel(out3d.reshape(6, 72), ref, TOL[torch.float32], f"{isa} 3-d x")
    strided = torch.zeros(6, 1152)[:, ::2]
    strided.copy_(x)
    assert not strided.is_contiguous()
    assert_rel(OP(*_args(w_big, strided)), ref, TOL[torch.float32], f"{isa} strided x")
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for m, w in ((9, w_big), (1, w_small), (3, w_big), (1, w_big), (2, w_small)):
                xm = _act(m, w.shape[1], torch.float32, seed=m)
                assert_rel(OP(*_args(w, xm)), linear_int4wo_tiled_ref(*_args(w, xm)), TOL[torch.float32],
                           f"{isa} {nt} threads m={m} n={w.shape[0]}")
    finally:
        torch.set_num_threads(threads)


@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 40])
def test_unaligned_inputs(monkeypatch, isa, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _tiled(37, 320, 32, 8, torch.bfloat16)
    x = _act(m, 320, torch.bfloat16)
    qu, su, xu = unaligned(w.qdata, 4), unaligned(w.scale_and_zero, 2), unaligned(x, 2)
    assert qu.data_ptr() % 16 == 4 and su.data_ptr() % 16 == 2 and xu.data_ptr() % 16 == 2
    out = OP(xu, qu, su, 32, 37, None)
    assert_rel(out, linear_int4wo_tiled_ref(*_args(w, x)), TOL[torch.bfloat16], isa)


@needs_ext
@pytest.mark.parametrize("m", [2, 40])
def test_sliced_tiles_are_read_in_place(m):
    # Slicing along out_features keeps whole n-tiles, along in_features whole chunks: both are strided
    # views of the tiles and of scale_and_zero, which the kernel reads without a copy.
    w = _tiled(48, 512, 64, 4)
    rows, cols = w[8:40], w[:, 128:384]
    assert rows.scale_and_zero.stride(0) == 2 * 48 and cols.qdata.stride(0) == w.qdata.stride(0)
    for part in (rows, cols):
        x = _act(m, part.shape[1], torch.float32)
        assert_rel(F.linear(x, part), F.linear(x, part.dequantize()), 2e-5, str(part.shape))


def test_empty_batch_and_bad_arguments():
    w = _tiled(8, 64, 32, 2)
    assert OP(*_args(w, torch.empty(0, 64))).shape == (0, 8)
    if LEVELS:
        with pytest.raises(RuntimeError, match="features but the tiles hold"):
            OP(*_args(w, torch.randn(2, 128)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    w = _tiled(24, 96, 32, 4, dtype)
    x = _act(3, 96, dtype).reshape(1, 3, 96)
    torch.library.opcheck(OP, _args(w, x, torch.randn(24).to(dtype)))
    torch.library.opcheck(OP, _args(w, x.requires_grad_()))


@needs_ext
def test_cpu_kernel_registered_and_reported():
    op = "torchqkit::linear_int4wo_tiled"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
    assert kernels.cpu_backend(op)[0] == f"cpp {running_level(LEVELS)}"
    row = next(r for r in kernels.status() if r["layout"] == "tensor_core_tiled")
    assert row["path"] == f"{op} (cpp {running_level(LEVELS)})"


# ------------------------------------------------------------------------------------------------
# Through TensorCoreTiledLayout
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layout_linear_uses_the_op(dtype):
    lin = torch.nn.Linear(256, 40).to(dtype)
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=64))
    x = _act(3, 256, dtype)
    log = OpLog()
    with log, torch.no_grad():
        out = lin(x)
    assert log.ops == ["linear_int4wo_tiled"]
    # Half weights: the reference rounds the dequantized weight to bf16 / fp16 before its matmul, the op
    # keeps (q - 8) * s + z in fp32: a few ulps of the weight dtype, relative to the output's magnitude.
    tol = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -5, torch.float16: 2.0 ** -8}[dtype]
    assert_rel(out, F.linear(x, lin.weight.dequantize(), lin.bias), tol, str(dtype))


def test_reference_preference_and_float64_keep_the_reference():
    w = _tiled(16, 64, 32, 2, pref="reference")
    log = OpLog()
    with log:
        F.linear(_act(2, 64, torch.float32), w)
    assert "linear_int4wo_tiled" not in log.ops
    w64 = _tiled(16, 64, 32, 2, torch.float64)
    x = _act(2, 64, torch.float64)
    log = OpLog()
    with log:
        out = F.linear(x, w64)
    assert "linear_int4wo_tiled" not in log.ops
    torch.testing.assert_close(out, F.linear(x, w64.dequantize()))


def test_compile_fullgraph_calls_the_custom_op():
    lin = torch.nn.Linear(128, 24)
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=32))
    assert_compiled_calls_op(lin, _act(4, 128, torch.float32), "linear_int4wo_tiled")


def test_input_gradient_flows_through_the_dequantized_weight():
    w = _tiled(24, 128, 32, 4)
    x = _act(3, 128, torch.float32).requires_grad_()
    b = torch.zeros(24, requires_grad=True)
    F.linear(x, w, b).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 24) @ w.dequantize(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, torch.full((24,), 3.0))


# ------------------------------------------------------------------------------------------------
# int8 dynamic activation x int4 PackedIntxLayout weights: torchqkit::linear_int8da_int4_packed
# ------------------------------------------------------------------------------------------------

DA4 = torch.ops.torchqkit.linear_int8da_int4_packed


def _int4_packed(n, k, group, weight_mapping="symmetric", dtype=torch.float32, seed=0, pref="auto"):
    w = torch.randn(n, k, generator=gen(seed)).to(dtype)
    act = qk.ActivationQuantSpec(qk.qdtypes.int8, qk.PerToken(), "asymmetric")
    return qk.quantize_weight(w, qk.qdtypes.int4, qk.PerGroup(group), qk.PackedIntxLayout(), mapping=weight_mapping,
                              act_quant=act, kernel_preference=pref)


# (M, N, K, group, weight mapping): M = 1, 3, 4 (4-token passes + a tail) and, from M = 12 (16 on AVX2 / AVX-VNNI:
# M = 13 is on either side), the panel paths (Note [int8 x int4 prefill]: 6-token micro-tiles + a tail, 32-column
# panels + a tail, group sums in registers over panels of 4096 k; on AVX2 / AVX-VNNI Note [int8 x int4 prefill on
# 256 bits]: 16-column panels, AVX2 4-token tiles with int16 windows of 32 k, AVX-VNNI 6-token tiles over panels of
# 4096 k); K = 8
# (smallest: one lane), K not a multiple of the 128-k block (200, 96, 77 odd: half a byte), groups of 8 / 32 /
# 64 / 128 / 256 and per channel (group = K); asymmetric weights carry int zero points. K = 4200 per channel: the
# AVX-512 / AVX-VNNI panels of 4096 k (Note [int8 x int4 prefill, group sums in registers]) and a last block of
# 104 k.
DA4_CASES = [(1, 1, 8, 8, "symmetric"), (3, 37, 96, 32, "asymmetric"), (17, 19, 256, 64, "symmetric"),
             (40, 40, 512, 128, "asymmetric"), (2, 9, 512, 256, "asymmetric"), (4, 11, 200, 8, "symmetric"),
             (1, 5, 77, 77, "asymmetric"), (3, 33, 1030, 1030, "symmetric"), (16, 70, 200, 8, "asymmetric"),
             (20, 33, 77, 77, "symmetric"), (23, 65, 1030, 1030, "asymmetric"), (18, 9, 512, 256, "symmetric"),
             (33, 5, 8, 8, "asymmetric"), (9, 21, 264, 8, "asymmetric"), (257, 7, 136, 8, "symmetric"),
             (19, 31, 96, 32, "asymmetric"), (21, 17, 320, 64, "symmetric"), (18, 35, 4200, 4200, "asymmetric"),
             (13, 29, 384, 128, "asymmetric")]


@needs_ext
@pytest.mark.parametrize("isa", DA4_LEVELS or ["none"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["act_sym", "act_asym"])
@pytest.mark.parametrize("act_bits", [8, 4], ids=["a8", "a4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DA4_CASES, ids=str)
def test_int8da_int4_matches_reference(monkeypatch, isa, symmetric, act_bits, dtype, case):
    # Same activation codes (the oracle's numerics, as in linear_int8da_int8_plain; int4 codes -8..7 with act_bits
    # 4, W4A4); the kernel's sums are exact int32 per group, scaled in fp32: budget TOL (summation order), measured
    # <= 2e-6 in fp32.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    _check_da4_case(isa, symmetric, dtype, case, act_bits)


def _check_da4_case(isa, symmetric, dtype, case, act_bits=8):
    m, n, k, group, wmap = case
    w = _int4_packed(n, k, group, wmap)
    x = (_act(m, k, torch.float32) + (0 if symmetric else 1.5)).to(dtype)
    b = torch.randn(n, generator=gen(2)).to(dtype)
    args = (x, w.qdata, w.scale, w.zero_point, b, symmetric, 0, act_bits)
    from torchqkit.kernels.reference import linear_int8da_int4_packed_ref
    assert_rel(DA4(*args), linear_int8da_int4_packed_ref(*args), TOL[dtype], f"{isa} {case}")


@needs_ext
@pytest.mark.parametrize("isa", DA4_LEVELS or ["none"])
@pytest.mark.parametrize("m", [3, 20])
def test_int8da_int4unaligned(monkeypatch, isa, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _int4_packed(37, 96, 32, "asymmetric", torch.bfloat16)
    x = _act(m, 96, torch.bfloat16)
    qu, su, zu, xu = unaligned(w.qdata, 1), unaligned(w.scale, 2), unaligned(w.zero_point, 3), unaligned(x, 2)
    assert qu.data_ptr() % 16 == 1 and xu.data_ptr() % 16 == 2
    from torchqkit.kernels.reference import linear_int8da_int4_packed_ref
    assert_rel(DA4(xu, qu, su, zu, None, False), linear_int8da_int4_packed_ref(x, w.qdata, w.scale, w.zero_point, None, False),
                TOL[torch.bfloat16], isa)


# Decode sizes on small-LLM shapes (SmolLM2-135M: K = 576 = 4.5 blocks of 128 k, 1536) and K = 72 (a 4-byte tail
# past a whole 32-byte vector), M = 1..9: the decode kernel's masked tail loads, scales staged 16 rows at a time
# (N = 37: two stages and a short one), symmetric weights' lane sums and the zero-point term in int32
# (Note [int8 x int4 decode]).
DA4_DECODE_CASES = [(1, 37, 576, 32, "symmetric"), (2, 5, 576, 64, "symmetric"), (5, 17, 1536, 128, "symmetric"),
                    (9, 3, 576, 32, "asymmetric"), (6, 33, 72, 8, "symmetric"), (8, 16, 1536, 32, "asymmetric"),
                    (7, 9, 576, 576, "symmetric"), (1, 40, 136, 8, "asymmetric")]


@needs_ext
@pytest.mark.parametrize("isa", DA4_LEVELS or ["none"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["act_sym", "act_asym"])
@pytest.mark.parametrize("case", DA4_DECODE_CASES, ids=str)
def test_int8da_int4_decode_small_llm_shapes(monkeypatch, isa, symmetric, case):
    # Tolerance as test_int8da_int4_matches_reference: exact int32 sums, fp32 scaling.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    _check_da4_case(isa, symmetric, torch.float32, case)


@needs_ext
@pytest.mark.parametrize("isa", DA4_LEVELS or ["none"])
@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("wmap", ["asymmetric", "symmetric"])
def test_int8da_int4_extreme_activation_zero_points(monkeypatch, isa, m, wmap):
    # Non-negative rows (after a ReLU) get the lowest zero point, -128, and one row of a constant its own
    # scale: the zero-point term (- zp * sum u) at its largest (-zp = 128 is one byte more than vpdpbusd's
    # signed operand holds), and next to other rows' in one pass / tile.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = _int4_packed(19, 160, 32, wmap)
    x = _act(m, 160, torch.float32).abs()
    x[0] = 3.0
    args = (x, w.qdata, w.scale, w.zero_point, None, False)
    from torchqkit.kernels.reference import linear_int8da_int4_packed_ref
    assert_rel(DA4(*args), linear_int8da_int4_packed_ref(*args), TOL[torch.float32], f"{isa} m={m}")


# The AVX2 decode adds the activation zero point's term (nibble sums times -zp) to its int16 pair sums before the one
# vpmaddwd: constant weight rows put every nibble at 15 (or 0 / 1), and constant-sign activations every code at an end
# of its range with a zero point at an end too, so the int16 sums reach their largest magnitude (about 30700 of
# 32767) with both signs; a saturated lane would show as a wrong row. Groups of 128 (one scale per block) and 32.
@needs_ext
@pytest.mark.parametrize("isa", DA4_LEVELS or ["none"])
@pytest.mark.parametrize("group", [128, 32])
def test_int8da_int4_largest_pair_sums(monkeypatch, isa, group):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    k = 384
    w = torch.randn(6, k, generator=gen(3))
    w[0], w[1], w[2] = 1.0, -1.0, torch.tensor([1.0, -1.0]).repeat(k // 2)
    act = qk.ActivationQuantSpec(qk.qdtypes.int8, qk.PerToken(), "asymmetric")
    q = qk.quantize_weight(w, qk.qdtypes.int4, qk.PerGroup(group), qk.PackedIntxLayout(), mapping="symmetric",
                           act_quant=act)
    x = torch.rand(4, k, generator=gen(4)) * 4
    x[1] = -x[1]
    x[2] = x[2] + 50.0  # all codes high, zero point at its lowest
    x[3, 1:] = 7.0  # one low value, the rest at the top code
    from torchqkit.kernels.reference import linear_int8da_int4_packed_ref
    for m in (1, 4):
        args = (x[:m], q.qdata, q.scale, q.zero_point, None, False)
        assert_rel(DA4(*args), linear_int8da_int4_packed_ref(*args), TOL[torch.float32], f"{isa} g={group} m={m}")


# Per-(token, group) activation scales (act_group_size = the weight's group) and float zero points (GGUF Q4_1's
# w = q s + z), alone and together, on every path: decode passes of 1..4 tokens and tails (M = 1, 3, 5), both panel
# paths (M = 17, 40: AVX-512 6-token tiles / AMX, 256-bit 16-column panels), groups of 8 / 32 / 64 / 128 / 256
# (a group spanning blocks), K = 576 (SmolLM2: 4.5 blocks of 128 k, a masked tail), 72 (one vector and a tail);
# K = 4608 in groups of 384: an AVX-512 / AVX-VNNI panel of 4096 k ends inside a group.
DA4_GROUP_CASES = [(1, 37, 576, 32), (3, 9, 96, 32), (5, 17, 1536, 64), (17, 19, 256, 8), (40, 40, 512, 128),
                   (2, 9, 512, 256), (20, 70, 576, 32), (1, 3, 72, 8), (4, 33, 576, 32), (17, 33, 4608, 384)]


@needs_ext
@pytest.mark.parametrize("isa", DA4_LEVELS or ["none"])
@pytest.mark.parametrize("zero", ["none", "int", "float"])
@pytest.mark.parametrize("act_groups", [False, True], ids=["act_per_token", "act_per_group"])
@pytest.mark.parametrize("act_bits", [8, 4], ids=["a8", "a4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DA4_GROUP_CASES, ids=str)
def test_int8da_int4_group_activations_and_float_zero_points(monkeypatch, isa, zero, act_groups, act_bits, dtype,
                                                             case):
    # Tolerance as test_int8da_int4_matches_reference: exact int32 sums per group, fp32 scaling (measured <= 5e-7).
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    m, n, k, group = case
    g = gen(7)
    q = torch.randint(0, 256, (n, (k + 1) // 2), dtype=torch.uint8, generator=g)
    s = ((torch.rand(n, k // group, generator=g) + 0.5) * 0.01).to(dtype)
    z = {"none": None, "int": torch.randint(-8, 8, s.shape, generator=g).to(torch.int8),
         "float": (torch.randn(s.shape, generator=g) * 0.05).to(dtype)}[zero]
    # feature magnitudes 0.1 .. 5 along K: one scale per token would flatten the small features
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.1, 5, k)).to(dtype)
    args = (x, q, s, z, torch.randn(n, generator=g).to(dtype), True, group if act_groups else 0, act_bits)
    from torchqkit.kernels.reference import linear_int8da_int4_packed_ref
    assert_rel(DA4(*args), linear_int8da_int4_packed_ref(*args), TOL[dtype], f"{isa} {case} {zero}")


def test_int8da_int4_group_activations_are_closer_to_float():
    # The point of per-group activation scales: with features of very different magnitudes (an LLM's outlier
    # channels), one scale per token rounds the small features away; per group only the outliers' own group shares
    # their scale.
    k, n = 576, 64
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen(4))
    s = torch.full((n, k // 32), 0.01)
    s[:, 2] = 0  # the outliers' group weighs nothing: the output is the small features' alone
    wf = linear_int8da_int4_packed_weight_f32(q, s, k)
    x = torch.randn(2, k, generator=gen(5))
    x[:, 64:96] *= 100  # one group of outlier features
    exact = x @ wf.t()
    err = {}
    for groups in (0, 32):
        out = DA4(x, q, s, None, None, True, groups)
        err[groups] = ((out - exact).norm() / exact.norm()).item()
    assert err[32] < 1e-2 and err[0] > 20 * err[32], err  # measured: 6.6e-3 per group, 0.40 per token


def test_int4_activation_codes_are_the_oracles():
    # act_bits = 4: the kernel's product is F.linear of the activation quantized to int4 by ActivationQuantSpec (the
    # oracle) with the dequantized weight, at every token count of the decode and panel paths
    w = _int4_packed(48, 256, 32)
    for m in (1, 5, 20):
        for mapping in ("symmetric", "asymmetric"):
            x = _act(m, 256, torch.float32) + (0 if mapping == "symmetric" else 1.5)
            spec = qk.ActivationQuantSpec(qk.qdtypes.int4, qk.PerToken(), mapping)
            ref = torch.nn.functional.linear(spec.fake_quantize(x), w.dequantize())
            out = DA4(x, w.qdata, w.scale, w.zero_point, None, mapping == "symmetric", 0, 4)
            assert_rel(out, ref, TOL[torch.float32], f"m={m} {mapping}")
    with pytest.raises(RuntimeError, match="act_bits must be 8 or 4, got 2"):
        DA4(x, w.qdata, w.scale, w.zero_point, None, True, 0, 2)


def linear_int8da_int4_packed_weight_f32(q, s, k):
    from torchqkit.kernels.reference import int4_packed_weight
    return int4_packed_weight(q, s, None, k)


def test_int8da_int4_act_group_size_errors():
    q = torch.zeros(4, 32, dtype=torch.uint8)
    s = torch.ones(4, 2)
    x = torch.randn(1, 64)
    for bad, symmetric in ((16, True), (32, False), (64, True)):
        with pytest.raises(RuntimeError, match="act_group_size .* must be 0 .* or the weight's group size 32"):
            DA4(x, q, s, None, None, symmetric, bad)
    with pytest.raises(RuntimeError, match="zero_point must be shaped like scale"):
        DA4(x, q, s, torch.zeros(4, 1), None, True, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8da_int4_opcheck(dtype):
    w = _int4_packed(24, 96, 32, "asymmetric", dtype)
    x = _act(3, 96, dtype).reshape(1, 3, 96)
    torch.library.opcheck(DA4, (x, w.qdata, w.scale, w.zero_point, torch.randn(24).to(dtype), False))
    torch.library.opcheck(DA4, (x.requires_grad_(), w.qdata, w.scale, None, None, True))
    torch.library.opcheck(DA4, (x.detach(), w.qdata, w.scale, w.scale * 0.5, None, True, 32))


def test_int8da_int4_config_routes_to_the_op_and_matches_fake_quant():
    config = qk.Int8DynamicActivationIntxWeightConfig(weight_bits=4)
    assert config.resolved_layout() == qk.PackedIntxLayout()
    assert qk.Int8DynamicActivationIntxWeightConfig(weight_bits=3).resolved_layout() == qk.PlainLayout()
    lin = torch.nn.Linear(256, 40)
    qk.quantize_(lin, config)
    x = _act(5, 256, torch.float32)
    log = OpLog()
    with log, torch.no_grad():
        out = lin(x)
    assert log.ops == ["linear_int8da_int4_packed"]
    w = lin.weight
    ref = F.linear(w.act_quant.fake_quantize(x), w.dequantize(), lin.bias)  # fp32: summation order only
    assert_rel(out, ref, 2e-5, "layout")
    if LEVELS:
        row = next(r for r in kernels.status()
                   if r["linear"].startswith("int8 or int4 dynamic act (per token, or per token and weight group) x int4"))
        assert row["path"] == f"torchqkit::linear_int8da_int4_packed (cpp {running_level(DA4_LEVELS)})"


def test_int8da_int4_compile_fullgraph_calls_the_op():
    lin = torch.nn.Linear(128, 24)
    qk.quantize_(lin, qk.Int8DynamicActivationIntxWeightConfig(weight_bits=4))
    assert_compiled_calls_op(lin, _act(4, 128, torch.float32), "linear_int8da_int4_packed")


@pytest.mark.skipif(len(VNNI_BUILDS) < 2 or "avx_vnni" not in DA4_LEVELS,
                    reason="needs a CPU with AVX-VNNI and AVX-512 VNNI")
@pytest.mark.parametrize("m", [1, 3, 20])
def test_avx_vnni_builds_agree(monkeypatch, m):
    """The VEX and EVEX builds of every AVX-VNNI kernel give the same bits: the int16-pair int4 decode (M = 1), the
    int8 x int4 decode and panels, the int8 x int8 panels (M >= 16); the VEX build is checked against the reference
    by the tests above."""
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx_vnni")
    monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", "int16")
    w4, d4 = _tiled(45, 576, 32, 8), _int4_packed(45, 576, 64, "asymmetric")
    act = qk.ActivationQuantSpec(qk.qdtypes.int8, qk.PerToken(), "asymmetric")
    d8 = qk.quantize_weight(torch.randn(45, 576, generator=gen(3)), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout(),
                            mapping="symmetric", act_quant=act, scale_dtype=torch.float32)
    x = _act(m, 576, torch.float32)
    calls = {"int4 tiled": lambda: OP(*_args(w4, x)),
             "int8 x int4": lambda: DA4(x, d4.qdata, d4.scale, d4.zero_point, None, False),
             "int8 x int8": lambda: torch.ops.torchqkit.linear_int8da_int8_plain(x, d8.qdata, d8.scale, None, False)}
    for what, call in calls.items():
        got = {}
        for build in ("vex", "evex"):
            monkeypatch.setenv("TORCHQKIT_CPU_AVX_VNNI", build)
            got[build] = call()
        assert torch.equal(got["vex"], got["evex"]), f"{what} M = {m}"


def test_avx_vnni_build_variable_is_checked(monkeypatch):
    if "avx_vnni" not in LEVELS:
        pytest.skip("no AVX-VNNI level on this CPU")
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx_vnni")
    monkeypatch.setenv("TORCHQKIT_CPU_AVX_VNNI", "sse")
    w = _tiled(8, 256, 128, 8)
    with pytest.raises(RuntimeError, match="TORCHQKIT_CPU_AVX_VNNI=sse is not one of vex, evex"):
        OP(*_args(w, _act(1, 256, torch.float32)))


@pytest.mark.skipif("avx_vnni" not in LEVELS, reason="no AVX-VNNI level on this CPU")
def test_smollm2_int16_pair_decode_keeps_the_avx2_tokens(monkeypatch):
    """SmolLM2-135M, every Linear and the tied lm_head int4 g128 (inner_k_tiles 8): greedy decoding at the AVX-VNNI
    level (the int16-pair kernel pinned for every one-token call) gives the AVX2 level's tokens, and the next-token
    logits within float32 rounding of them."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", "int16")
    from torchqkit.eval import LeanDecoder, load_gguf, smollm2_gguf_path

    model, tokenizer = load_gguf(smollm2_gguf_path())
    config = qk.Int4WeightOnlyConfig(group_size=128)
    qk.quantize_(model, qk.ModuleConfigs({"lm_head": config, "_default": config}), strict=True)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    tokens, logits = {}, {}
    with torch.inference_mode():
        for level in ("avx2", "avx_vnni"):
            monkeypatch.setenv("TORCHQKIT_CPU_ISA", level)
            tokens[level] = LeanDecoder(model, ids.shape[1] + 8).generate(ids[0], 8).tolist()
            logits[level] = model(ids[:, -1:]).logits[0, -1]
    assert tokens["avx_vnni"] == tokens["avx2"]
    assert_rel(logits["avx_vnni"], logits["avx2"], 1e-5, "SmolLM2 one-token logits")
