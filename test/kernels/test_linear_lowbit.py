"""torchqkit::linear_nf4wo, linear_fp8wo and linear_intxwo: the C++ CPU kernels (csrc/cpu/linear_lowbit*.cpp)
on the layouts' own bytes against F.linear(x, w.dequantize()), under every ISA level this CPU runs (avx512_bf16
included: bf16 activations there take the vdpbf16ps kernels); opcheck, unaligned data, routing from the layouts,
autograd (QLoRA), torch.compile."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit import kernels
from torchqkit.kernels.precision import float32_matmul_precision

from cpu_kernel_testing import OpLog, assert_compiled_calls_op, assert_every_token_count, assert_rel, cpu_levels, gen, quantized_linear
from cpu_kernel_testing import isa_param as isa_param_for
from cpu_kernel_testing import needs_kernel, running_level, unaligned
from torchqkit.core import qdtypes as Q

NF4 = torch.ops.torchqkit.linear_nf4wo
FP8 = torch.ops.torchqkit.linear_fp8wo
INTX = torch.ops.torchqkit.linear_intxwo
MX = torch.ops.torchqkit.linear_mxwo
LEVELS = cpu_levels("torchqkit::linear_nf4wo", with_avx512_bf16=True)
needs_ext = needs_kernel(LEVELS)
isa_param = isa_param_for(LEVELS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Kernel vs reference on the same stored bytes: both decode to the same float32 weights (the kernel's
# w = level * s (+ offset) may round once more than the oracle's (q - z) * s, ~1e-7 relative) and accumulate in
# float32 in different orders (~K * 2^-24 relative: budget 2e-5 of max |ref|). Half-precision outputs add
# one rounding of nearly equal fp32 values: one ulp of the output (2^-8 bf16, 2^-11 fp16), budget 2 ulps.
# The AVX512-BF16 kernels multiply bf16 levels (exact, but nf4's rounded to bf16: <= 2^-9 relative each, measured
# 5e-4 of max |y| at K = 4096, an eighth of an output ulp) and sum in fp32: the same budget.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}




def _act(m, k, dtype, seed=1):
    return (torch.randn(m, k, generator=gen(seed)) * 3).to(dtype)


def _float_weight(n, k, seed=0):
    return torch.randn(n, k, generator=gen(seed)) * 0.05


# ------------------------------------------------------------------------------------------------
# weights from the layouts themselves; each case: (name, aqt builder, op call on the aqt's inner tensors)
# ------------------------------------------------------------------------------------------------

def _nf4(n, k, block, dq):
    return qk.quantize_weight(_float_weight(n, k), Q.nf4, qk.PerGroup(block), qk.NF4Layout(block, dq),
                              scale_dtype=torch.float32)


def _fp8(n, k, qdtype, granularity):
    return qk.quantize_weight(_float_weight(n, k), qdtype, granularity, qk.Float8Layout(), scale_dtype=torch.float32)


def _intx(n, k, bits, granularity, mapping="symmetric", signed=True, zero_point_domain=None):
    qdtype = getattr(Q, f"{'' if signed else 'u'}int{bits}")
    return qk.quantize_weight(_float_weight(n, k), qdtype, granularity, qk.PackedIntxLayout(), mapping=mapping,
                              zero_point_domain=zero_point_domain)


def _mx(n, k, qdtype):
    return qk.quantize_weight(_float_weight(n, k), qdtype, qk.PerGroup(32), qk.MXLayout(), scale_rounding="power_of_two")


def _call(w, x, bias):
    """The op a layout routes to, on the weight's stored tensors."""
    if isinstance(w.qlayout, qk.MXLayout):
        return MX(x, w.qdata, w.scale, bias)
    if isinstance(w.qlayout, qk.NF4Layout):
        return NF4(x, w.qdata, w.scale, w.scale_codes, w.scale_block_scale, w.scale_offset, w.qlayout.block_size, bias)
    if isinstance(w.qlayout, qk.Float8Layout):
        return FP8(x, w.qdata, w.scale, bias)
    return INTX(x, w.qdata, w.scale, w.zero_point, w.qdtype.bits, w.qdtype.signed, w.zero_point_domain.value, bias)


def _reference(w, x, bias):
    return F.linear(x.float(), w.dequantize().float(), None if bias is None else bias.float()).to(x.dtype)


# (M, K, N): M = 1 (decode), 3 (odd, dot kernel), 7 (nf4 / float8: dot kernel, a pass of 4 tokens + 3; intx: fp32
# blocks), 17 (prefill path, odd), 130 (below AVX-512: rows dequantized for ATen's sgemm); N not a multiple of 4 / 16;
# K at the smallest legal size for each format, K not a multiple of 16 (tail chunk), K > one prefill block.
WEIGHTS = {
    "nf4_b2_minK": lambda: _nf4(5, 2, 2, False),
    "nf4_b64": lambda: _nf4(37, 192, 64, False),
    "nf4_b6_odd_groups": lambda: _nf4(19, 42, 6, False),
    "nf4_b64_dq": lambda: _nf4(37, 192, 64, True),
    "nf4_b32_dq_many_groups": lambda: _nf4(70, 1056, 32, True),
    "nf4_b10_dq_odd": lambda: _nf4(29, 50, 10, True),
    "e4m3_row": lambda: _fp8(37, 100, Q.float8_e4m3fn, qk.PerRow()),
    "e4m3_tensor_minK": lambda: _fp8(3, 1, Q.float8_e4m3fn, qk.PerTensor()),
    "e4m3_block32x16": lambda: _fp8(64, 96, Q.float8_e4m3fn, qk.PerBlock((32, 16))),
    "e5m2_row": lambda: _fp8(41, 1100, Q.float8_e5m2, qk.PerRow()),
    "e5m2_tensor": lambda: _fp8(17, 33, Q.float8_e5m2, qk.PerTensor()),
    "e4m3fnuz_row": lambda: _fp8(37, 100, Q.float8_e4m3fnuz, qk.PerRow()),  # AMD's fnuz: Note [float8 fnuz bytes]
    "e5m2fnuz_block32x16": lambda: _fp8(64, 1088, Q.float8_e5m2fnuz, qk.PerBlock((32, 16))),
    "int2_g32": lambda: _intx(37, 96, 2, qk.PerGroup(32)),
    "int3_g16_asym": lambda: _intx(33, 80, 3, qk.PerGroup(16), "asymmetric"),
    "int3_row_minK": lambda: _intx(9, 1, 3, qk.PerRow()),
    "int5_g32": lambda: _intx(21, 1088, 5, qk.PerGroup(32)),
    "int6_g24_asym_odd_groups": lambda: _intx(19, 72, 6, qk.PerGroup(24), "asymmetric"),
    "uint6_g32": lambda: _intx(23, 64, 6, qk.PerGroup(32), "asymmetric", signed=False),
    "int4_row_odd_K": lambda: _intx(35, 37, 4, qk.PerRow()),
    "int7_g64": lambda: _intx(18, 128, 7, qk.PerGroup(64)),
    "int1_row": lambda: _intx(18, 40, 1, qk.PerRow(), "asymmetric", signed=False),
    "mxfp4_minK": lambda: _mx(5, 32, Q.fp4_e2m1),
    "mxfp4": lambda: _mx(37, 1088, Q.fp4_e2m1),
    "mxfp8_e4m3": lambda: _mx(21, 96, Q.float8_e4m3fn),
    "mxfp8_e5m2": lambda: _mx(19, 160, Q.float8_e5m2),
}


@pytest.fixture(scope="module")
def weights():
    return {name: make() for name, make in WEIGHTS.items()}


@needs_ext
@isa_param
# 17 / 130: rows dequantized for a GEMM (AVX2: the 256-bit panels past the dot kernel, ATen's sgemm from 130 on Intel),
# or the AVX-512 panels
@pytest.mark.parametrize("m", [1, 3, 7, 17, 130])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_kernel_matches_dequantized_reference(monkeypatch, weights, isa, m, name):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = weights[name]
    n, k = w.shape
    bias = torch.randn(n, generator=gen(2))
    for route in ("sgemm", "panels") if m >= 17 else ("",):  # Note [fp32 prefill by sgemm]
        monkeypatch.setenv("TORCHQKIT_CPU_FP32_PREFILL", route)
        for dtype in DTYPES:
            x = _act(m, k, dtype)
            b = bias.to(dtype) if dtype != torch.float16 else None
            assert_rel(_call(w, x, b), _reference(w, x, b), TOL[dtype], f"{isa} {name} M={m} {dtype} {route}")


@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("name", ["e5m2_row", "e4m3_row", "nf4_b64", "mxfp4", "int5_g32"])
def test_activation_rows_near_float32s_largest_value_stay_finite(monkeypatch, weights, isa, m, name):
    """Note [Activation rows past the decoders' range]: a row far past 2^64 runs scaled down by a
    power of two (the kernels multiply x by decoded codes before the scales, e5m2's up to 57344), so it gives the
    reference's finite output; the other rows are computed as without it, bit for bit."""
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = weights[name]
    n, k = w.shape
    x = _act(m, k, torch.float32)
    huge = x.clone()
    huge[0] = torch.randn(k, generator=gen(4)).sign() * 1e36  # e5m2 codes decode up to 57344: 5.7e40
    ref = _reference(w, huge, None)
    assert torch.isfinite(ref).all()
    out = _call(w, huge, None)
    assert torch.isfinite(out).all()
    assert_rel(out[:1], ref[:1], TOL[torch.float32], f"{isa} {name} M={m} huge row")
    assert torch.equal(out[1:], _call(w, x, None)[1:]) or m >= 17  # a prefill may take another GEMM per row count


# The dot kernel (decode) on every token count it tiles differently (1..9: AVX-512 tiles of 4 tokens, AVX2 of 2;
# intx switches to fp32 blocks above 4), on weights whose groups are whole 32-weight decode steps, with K not
# a multiple of 64 (a partial last step: the zero-padded copy), N odd (a short last tile of rows), and each
# decode route: nf4 / fp4 tables in dot order, float8 per row and per group (the e4m3 scale factor applied per
# row), intx through the one-instruction table (<= 3 / 4 bits) or integer conversion, with each zero point domain.
DOT_WEIGHTS = {
    "nf4_b32_K96_N13": lambda: _nf4(13, 96, 32, False),
    "nf4_b64_dq_K320_N7": lambda: _nf4(7, 320, 64, True),
    "nf4_b128_K384_N6": lambda: _nf4(6, 384, 128, False),  # groups of 4 steps
    "mxfp4_K160_N9": lambda: _mx(9, 160, Q.fp4_e2m1),
    "mxfp8_e4m3_K224_N11": lambda: _mx(11, 224, Q.float8_e4m3fn),
    "e4m3_g32_K224_N15": lambda: _fp8(15, 224, Q.float8_e4m3fn, qk.PerBlock((1, 32))),
    "e5m2_row_K97_N5": lambda: _fp8(5, 97, Q.float8_e5m2, qk.PerRow()),
    "e4m3fnuz_g32_K224_N15": lambda: _fp8(15, 224, Q.float8_e4m3fnuz, qk.PerBlock((1, 32))),
    "e5m2fnuz_row_K97_N5": lambda: _fp8(5, 97, Q.float8_e5m2fnuz, qk.PerRow()),
    "int2_g64_asym_K192_N11": lambda: _intx(11, 192, 2, qk.PerGroup(64), "asymmetric"),
    "int3_g32_K96_N9": lambda: _intx(9, 96, 3, qk.PerGroup(32)),
    "int5_g128_asym_K384_N5": lambda: _intx(5, 384, 5, qk.PerGroup(128), "asymmetric"),  # last group: a tail step
    "uint4_g32_float_zp_K160_N7": lambda: _intx(7, 160, 4, qk.PerGroup(32), "asymmetric", signed=False,
                                                zero_point_domain=qk.ZeroPointDomain.FLOAT),
    "int5_row_K41_N13": lambda: _intx(13, 41, 5, qk.PerRow()),
    "int7_g32_asym_K96_N3": lambda: _intx(3, 96, 7, qk.PerGroup(32), "asymmetric"),
    "int6_g32_K160_N7": lambda: _intx(7, 160, 6, qk.PerGroup(32)),  # AVX2: 24-byte steps, 12 per 128-bit lane
    "int1_g64_asym_K192_N5": lambda: _intx(5, 192, 1, qk.PerGroup(64), "asymmetric", signed=False),
    "int4_g32_K96_N9": lambda: _intx(9, 96, 4, qk.PerGroup(32)),  # AVX2: the fp4 byte planes on integer levels
}


@pytest.fixture(scope="module")
def dot_weights():
    return {name: make() for name, make in DOT_WEIGHTS.items()}


@needs_ext
@isa_param
@pytest.mark.parametrize("name", list(DOT_WEIGHTS))
def test_dot_kernel_every_token_count(monkeypatch, dot_weights, isa, name):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    assert_every_token_count(_call, _reference, dot_weights[name], TOL, f"{isa} {name}")


@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 40, 130])
def test_unaligned_inputs(monkeypatch, weights, isa, m):
    # safetensors can hand out tensors that are not 16-byte aligned: every pointer is odd here.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    for name in ("nf4_b64_dq", "e4m3_row", "int5_g32", "mxfp4", "int2_g32"):
        w = weights[name]
        n, k = w.shape
        x, bias = _act(m, k, torch.float32), torch.randn(n, generator=gen(3))
        uw = w.with_changes({t: None if v is None else unaligned(v, 1 if v.element_size() == 1 else 4)
                             for t, v in w.inner_tensors().items()})
        assert uw.qdata.data_ptr() % 16 == 1
        assert_rel(_call(uw, unaligned(x, 4), unaligned(bias, 4)), _reference(w, x, bias), TOL[torch.float32], name)



def test_empty_batch(weights):
    for name in ("nf4_b64", "e5m2_row", "int3_g16_asym"):
        w = weights[name]
        assert _call(w, torch.empty(0, w.shape[1]), None).shape == (0, w.shape[0])


@pytest.mark.parametrize("name", ["nf4_b64", "nf4_b64_dq", "e4m3_row", "e5m2_tensor", "int3_g16_asym", "uint6_g32",
                                  "mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(weights, name, dtype):
    w = weights[name]
    n, k = w.shape
    x = _act(3, k, dtype).reshape(1, 3, k)
    bias = torch.randn(n, generator=gen(2)).to(dtype)
    args = {"nf4": lambda x, b: (x, w.qdata, w.scale, w.scale_codes, w.scale_block_scale, w.scale_offset,
                                 w.qlayout.block_size, b),
            "fp8": lambda x, b: (x, w.qdata, w.scale, b),
            "intx": lambda x, b: (x, w.qdata, w.scale, w.zero_point, w.qdtype.bits, w.qdtype.signed,
                                  w.zero_point_domain.value, b),
            "mx": lambda x, b: (x, w.qdata, w.scale, b)}
    kind = ("nf4" if name.startswith("nf4") else "fp8" if name.startswith("e") else "mx" if name.startswith("mx")
            else "intx")
    op = {"nf4": NF4, "fp8": FP8, "intx": INTX, "mx": MX}[kind]
    # torch's SchemaCheckMode compares inputs before / after with allclose, which float8 tensors lack
    # ("mul_cpu_reduced_float" not implemented): ops on float8 bytes skip that one check, no other.
    utils = [u for u in ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
             if not (w.qdata.dtype.is_floating_point and u == "test_schema")]
    torch.library.opcheck(op, args[kind](x, bias), test_utils=utils)
    torch.library.opcheck(op, args[kind](x.clone().requires_grad_(), None), test_utils=utils)


# The bf16 panels (AVX512-BF16 prefill): N not a multiple of the 32-row panel (a partial last panel, its 16-row
# halves transposed with zero rows), K over several 256-k blocks; scale segments of a whole group (g 32 / 64), of
# part of one (g 512 -> 256), of g 96 (blocks of 192), one per row with K not a multiple of 32 (tail step), and per
# block of rows (bn 16); intx zero points (the glue's xsum x offset matmul) in both domains; nf4 at K = 4096 (its
# levels rounded to bf16). Under every level: bf16 activations elsewhere take the fp32 kernels.
PANEL_WEIGHTS = {
    "nf4_b64_N70_K4096": lambda: _nf4(70, 4096, 64, False),
    "nf4_b512_dq_N33": lambda: _nf4(33, 1024, 512, True),
    "mxfp4_N45_K1056": lambda: _mx(45, 1056, Q.fp4_e2m1),
    "e4m3_block16x32_N48": lambda: _fp8(48, 640, Q.float8_e4m3fn, qk.PerBlock((16, 32))),
    "e5m2_row_N37_K1100": lambda: _fp8(37, 1100, Q.float8_e5m2, qk.PerRow()),
    "e4m3fnuz_row_N37_K1100": lambda: _fp8(37, 1100, Q.float8_e4m3fnuz, qk.PerRow()),
    "e5m2fnuz_block16x32_N48": lambda: _fp8(48, 640, Q.float8_e5m2fnuz, qk.PerBlock((16, 32))),
    "int3_g96_N35": lambda: _intx(35, 576, 3, qk.PerGroup(96)),
    "int5_g32_asym_N67": lambda: _intx(67, 320, 5, qk.PerGroup(32), "asymmetric"),
    "uint4_g64_float_zp_N19": lambda: _intx(19, 384, 4, qk.PerGroup(64), "asymmetric", signed=False,
                                            zero_point_domain=qk.ZeroPointDomain.FLOAT),
    "int2_row_asym_N9_K300": lambda: _intx(9, 300, 2, qk.PerRow(), "asymmetric"),
}


@pytest.fixture(scope="module")
def panel_weights():
    return {name: make() for name, make in PANEL_WEIGHTS.items()}


@needs_ext
@isa_param
@pytest.mark.parametrize("name", list(PANEL_WEIGHTS))
def test_bf16_activations_every_panel_shape(monkeypatch, panel_weights, isa, name):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = panel_weights[name]
    n, k = w.shape
    bias = torch.randn(n, generator=gen(2)).bfloat16()
    for m in (1, 5, 9, 17, 257):
        x = _act(m, k, torch.bfloat16, seed=m)
        assert_rel(_call(w, x, bias), _reference(w, x, bias), TOL[torch.bfloat16], f"{isa} {name} M={m}")


# float32 activations under torch.set_float32_matmul_precision("medium") take the bf16 kernels on AVX512-BF16 from
# the prefill M on (M > 8; intx M > 4): the result is the reference on x rounded to bf16 (exact levels, fp32 sums,
# intx zero points as fp32 group terms: 1e-4 of max |y|; nf4's levels rounded to bf16 add up to 1.3e-3 here at
# K = 4096: one bf16 ulp, 2^-8), far from the exact fp32 one; at decode M and under "highest" the fp32 kernels keep
# the fp32 budget.
@needs_ext
@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("name", ["nf4_b64_N70_K4096", "int5_g32_asym_N67", "uint4_g64_float_zp_N19",
                                  "e5m2_row_N37_K1100"])
@pytest.mark.parametrize("m", [3, 17])
def test_float32_activations_take_bf16_under_medium_precision(monkeypatch, panel_weights, name, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx512_bf16")  # whatever level the session forces
    w = panel_weights[name]
    n, k = w.shape
    x, b = _act(m, k, torch.float32, seed=m), torch.randn(n, generator=gen(2))
    exact, rounded = _reference(w, x, b), _reference(w, x.bfloat16().float(), b)  # before the switch: F.linear too
    op = "torchqkit::linear_nf4wo"
    with float32_matmul_precision("medium"):
        assert "in the bf16 kernels" in kernels.cpu_backend(op)[1]
        out = _call(w, x, b)
    if m > 8:
        assert_rel(out, rounded, 2.0 ** -8 if name.startswith("nf4") else 1e-4, f"medium {name} M = {m}")
        assert (out - exact).abs().max() > 1e-3 * exact.abs().max()
    else:
        assert_rel(out, exact, TOL[torch.float32], f"medium {name} M = {m}")
    assert "float32 activations: the fp32 kernels" in kernels.cpu_backend(op)[1]
    assert_rel(_call(w, x, b), exact, TOL[torch.float32], f"highest {name} M = {m}")


@needs_ext
def test_avx512_bf16_level_is_forceable_or_refused(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx512_bf16")
    if "avx512_bf16" not in LEVELS:
        with pytest.raises(RuntimeError, match="TORCHQKIT_CPU_ISA=avx512_bf16 but this CPU does not run it"):
            torch.ops.torchqkit_cpu.isa()
        return
    assert kernels.cpu_backend("torchqkit::linear_nf4wo")[0] == "cpp avx512_bf16"
    # Op families without a bf16 kernel name the level that really runs, and why.
    path, why = kernels.cpu_backend("torchqkit::linear_int8da_int8_plain")
    assert path == "cpp avx512_vnni" and "no bf16 dot-product kernel" in why
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx512_vnni")
    assert kernels.cpu_backend("torchqkit::linear_nf4wo")[0] == "cpp avx512_vnni"


# The AVX-VNNI level (Intel's client CPUs, the best level there) has no low-bit kernel of its own: it must run the
# AVX2 kernels, as the status says, not the scalar loops (which it once fell through to, 50-100x slower). Same
# kernels, same summation order: the outputs are bit-identical to AVX2's.
@needs_ext
@pytest.mark.skipif("avx_vnni" not in cpu_levels("torchqkit::linear_nf4wo", with_avx_vnni=True),
                    reason="the CPU runs no AVX-VNNI level")
@pytest.mark.parametrize("m", [1, 3, 130])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_avx_vnni_level_runs_the_avx2_kernels(monkeypatch, weights, m, name):
    w = weights[name]
    x = _act(m, w.shape[1], torch.float32)
    out = {}
    for level in ("avx_vnni", "avx2"):
        monkeypatch.setenv("TORCHQKIT_CPU_ISA", level)
        out[level] = _call(w, x, None)
    assert torch.equal(out["avx_vnni"], out["avx2"]), name
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "avx_vnni")
    assert "its AVX2 kernel runs" in kernels.cpu_backend("torchqkit::linear_nf4wo")[1]


@needs_ext
@pytest.mark.parametrize("op", ("torchqkit::linear_nf4wo", "torchqkit::linear_fp8wo", "torchqkit::linear_intxwo", "torchqkit::linear_mxwo"))
def test_cpu_kernel_registered_and_reported(monkeypatch, op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
    assert kernels.cpu_backend(op)[0] == f"cpp {running_level(LEVELS)}"
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "scalar")
    assert kernels.cpu_backend(op)[0] == "cpp scalar"


def test_nf4_levels_in_the_kernel_are_the_oracles(weights):
    # One code per level: a (1, 16) weight whose codes are 0..15 with absmax 1 reproduces qdtype.nf4.levels.
    qdata = torch.tensor([[0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]], dtype=torch.uint8)
    eye = torch.eye(16)
    out = NF4(eye, qdata, torch.ones(1, 1), None, None, None, 16, None)
    assert out.reshape(16).tolist() == list(Q.nf4.levels)


def test_fp4_codes_in_the_kernel_are_the_oracles():
    # MXFP4: one row whose 16 codes are 0..15 (low nibble first), scale 2^0 (E8M0 127): the e2m1 values.
    qdata = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] + [0] * 8], dtype=torch.uint8)
    out = MX(torch.eye(32)[:16], qdata, torch.full((1, 1), 127, dtype=torch.uint8), None)
    assert out.reshape(16).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    # E8M0 extremes: e = 0 is 2^-127 (subnormal), e = 254 is 2^127. Codes 0 (0.0) and 2 (1.0), the rest 0.
    zero_one = torch.tensor([[0x20] + [0] * 15], dtype=torch.uint8)
    for e, value in ((0, 2.0 ** -127), (1, 2.0 ** -126), (254, 2.0 ** 127)):
        out = MX(torch.eye(32)[:2], zero_one, torch.full((1, 1), e, dtype=torch.uint8), None)
        assert out.reshape(2).tolist() == [0.0, value]


# The dot kernel (M <= 8) decodes a 32-weight step into lanes in its own order at each level (AVX2: nf4 / fp4 through
# byte-plane lookups, x permuted to match; float8 through two 256-bit unpacks): with x one-hot at each position k of a
# step, row n returns exactly the level of its code at k, and the rows hold every code at every position.
def _one_hot_outputs(call, k_total=32):
    return torch.stack([call(torch.eye(k_total)[k:k + 1]).reshape(-1) for k in range(k_total)], dim=1)


@needs_ext
@isa_param
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_4bit_codes_in_every_decode_lane_at_one_token(monkeypatch, isa, fmt):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    codes = (torch.arange(16).reshape(16, 1) + torch.arange(32).reshape(1, 32)) % 16  # row n, position k
    first, second = codes[:, 0::2], codes[:, 1::2]  # element 2j and 2j + 1 of byte j
    if fmt == "nf4":  # element 2j in the high nibble
        qdata = (first << 4 | second).to(torch.uint8)
        levels = torch.tensor(Q.nf4.levels)
        out = _one_hot_outputs(lambda x: NF4(x, qdata, torch.ones(16, 1), None, None, None, 32, None))
    else:  # MXFP4: element 2j in the low nibble, scale 2^0
        qdata = (second << 4 | first).to(torch.uint8)
        levels = torch.tensor(Q.fp4_e2m1.levels)
        out = _one_hot_outputs(lambda x: MX(x, qdata, torch.full((16, 1), 127, dtype=torch.uint8), None))
    torch.testing.assert_close(out, levels[codes], rtol=0, atol=0)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) codes < 2^bits -> (N, ceil(K bits / 8)) uint8, code k at bits [k bits, (k + 1) bits) (LSB first)."""
    n, k = codes.shape
    stream = ((codes.reshape(n, k, 1) >> torch.arange(bits)) & 1).reshape(n, k * bits)
    stream = torch.nn.functional.pad(stream, (0, -(k * bits) % 8)).reshape(n, -1, 8)
    return (stream << torch.arange(8)).sum(-1).to(torch.uint8)


@needs_ext
@isa_param
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("bits", range(1, 8))
def test_intx_codes_in_every_decode_lane_at_one_token(monkeypatch, isa, bits, signed):
    # AVX2 cuts 1..4- and 6-bit codes in lanes of whole codes (its own dot order) and looks int4 up by byte planes.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    n = max(2 ** bits, 8)
    codes = (torch.arange(n).reshape(n, 1) + torch.arange(32).reshape(1, 32)) % 2 ** bits  # row n, position k
    qdata = _pack_bits(codes, bits)
    out = _one_hot_outputs(lambda x: INTX(x, qdata, torch.ones(n, 1), None, bits, signed, "none", None))
    torch.testing.assert_close(out, (codes - (2 ** (bits - 1) if signed else 0)).float(), rtol=0, atol=0)


FLOAT8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
# A NaN byte of each: e4m3fn's 0x7F / 0xFF, e5m2's exponent 31 with a mantissa, fnuz's only NaN 0x80.
NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F, torch.float8_e4m3fnuz: 0x80, torch.float8_e5m2fnuz: 0x80}


@needs_ext
@isa_param
@pytest.mark.parametrize("dt", FLOAT8_DTYPES, ids=str)
def test_float8_codes_in_every_decode_lane_at_one_token(monkeypatch, isa, dt):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    every = torch.arange(256, dtype=torch.uint8).view(dt)
    finite = every[every.float().isfinite()]  # a non-finite code times x's zeros would be NaN in every column
    rows = finite.reshape(-1, 1).expand(-1, 32).contiguous()  # row n: code n at every position
    out = _one_hot_outputs(lambda x: FP8(x, rows, torch.ones(rows.shape[0], 1), None))
    torch.testing.assert_close(out, rows.float(), rtol=0, atol=0)


@needs_ext
@isa_param
def test_float8_special_codes(monkeypatch, isa):
    # Every byte of the four float8 formats (subnormals, the largest values, NaN, inf; fnuz: 0x80 NaN, no -0, 0x7F /
    # 0xFF finite) decodes as torch's float8 does: one code per row (a partial decode step); every finite code in one
    # row (whole steps); a NaN code among finite ones.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    for dt in FLOAT8_DTYPES:
        codes = torch.arange(256, dtype=torch.uint8).view(dt).reshape(256, 1)
        out = FP8(torch.ones(1, 1), codes, torch.ones(1, 1), None).reshape(256)
        torch.testing.assert_close(out, codes.float().reshape(256), rtol=0, atol=0, equal_nan=True)
        finite = codes.reshape(256)[codes.float().reshape(256).isfinite()]
        out = FP8(torch.eye(finite.numel()), finite.reshape(1, -1), torch.ones(1, 1), None).reshape(-1)
        torch.testing.assert_close(out, finite.float(), rtol=0, atol=0)
        row = finite[:64].clone().reshape(1, 64)
        row.view(torch.uint8)[0, 37] = NAN_BYTE[dt]
        assert FP8(torch.ones(2, 64), row, torch.ones(1, 1), None).isnan().all()


@needs_ext
@isa_param
@pytest.mark.parametrize("case", ["e4m3_row", "mxfp8_e4m3", "e4m3fnuz_row", "e5m2fnuz_row"])
def test_e4m3_nan_code_in_a_whole_step(monkeypatch, isa, case):
    # The dot loop decodes e4m3 (and fnuz) without a per-step NaN check and reruns a tile that held a NaN code with
    # the checked decoder: the row with the NaN code (in a whole step, mid row) is NaN for every token; the other rows
    # of its tile and of the next tiles keep the reference's values.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    if case == "mxfp8_e4m3":
        w = _mx(7, 256, Q.float8_e4m3fn)
    else:
        w = _fp8(7, 256, {"e4m3_row": Q.float8_e4m3fn, "e4m3fnuz_row": Q.float8_e4m3fnuz,
                          "e5m2fnuz_row": Q.float8_e5m2fnuz}[case], qk.PerRow())
    w.qdata.view(torch.uint8)[2, 100] = 0x80 if "fnuz" in case else 0xFF  # fnuz's only NaN; -NaN in e4m3fn
    for m in (1, 2, 5):
        x = _act(m, 256, torch.float32, seed=m)
        out = _call(w, x, None)
        ref = _reference(w, x, None)
        assert out[:, 2].isnan().all() and ref[:, 2].isnan().all()
        keep = [0, 1, 3, 4, 5, 6]
        assert_rel(out[:, keep], ref[:, keep], TOL[torch.float32], f"{isa} {case} M={m}")


# ------------------------------------------------------------------------------------------------
# through the layouts
# ------------------------------------------------------------------------------------------------

LAYOUT_CASES = {
    "nf4": (lambda: qk.NF4WeightOnlyConfig(block_size=32), "linear_nf4wo"),
    "nf4_dq": (lambda: qk.NF4WeightOnlyConfig(block_size=32, double_quant=True), "linear_nf4wo"),
    "fp8_row": (lambda: qk.Float8WeightOnlyConfig(), "linear_fp8wo"),
    "nvfp4": (lambda: qk.NVFP4WeightOnlyConfig(), "linear_nvfp4wo"),
    "fp6_e3m2": (lambda: qk.FP6WeightOnlyConfig(), "linear_fp6wo"),
    "fp6_e2m3_g32": (lambda: qk.FP6WeightOnlyConfig(ebits=2, group_size=32), "linear_fp6wo"),
    "fp8_e5m2_block": (lambda: qk.Float8WeightOnlyConfig(weight_dtype=Q.float8_e5m2, granularity=qk.PerBlock((16, 32))),
                       "linear_fp8wo"),
    "fp8_e4m3fnuz_row": (lambda: qk.Float8WeightOnlyConfig(weight_dtype=Q.float8_e4m3fnuz), "linear_fp8wo"),
    "fp8_e5m2fnuz_block": (lambda: qk.Float8WeightOnlyConfig(weight_dtype="float8_e5m2fnuz",
                                                             granularity=qk.PerBlock((16, 32))), "linear_fp8wo"),
    "int3_g32": (lambda: qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(32)), "linear_intxwo"),
    "int6_asym": (lambda: qk.IntxWeightOnlyConfig(bits=6, granularity=qk.PerRow(), mapping="asymmetric"),
                  "linear_intxwo"),
    "mxfp4": (lambda: qk.MXFP4WeightOnlyConfig(), "linear_mxwo"),
    "mxfp8": (lambda: qk.MXFP8WeightOnlyConfig(), "linear_mxwo"),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layout_linear_uses_op_and_matches_dequantized(case, dtype):
    make, op = LAYOUT_CASES[case]
    lin = quantized_linear(make(), dtype)
    x = _act(5, 96, dtype)
    log = OpLog()
    with torch.no_grad(), log:
        out = lin(x)
    assert log.ops == [op]
    ref = F.linear(x, lin.weight.dequantize(), lin.bias)
    # fp32: summation order only. bf16: the reference rounds the dequantized weight to bf16 and
    # accumulates in bf16 matmul; the op computes in fp32 and rounds once: a few bf16 ulps of the output.
    assert_rel(out, ref, 2e-5 if dtype == torch.float32 else 2.0 ** -5, case)


@pytest.mark.parametrize("case", ["nf4", "int3_g32", "mxfp4"])
def test_reference_preference_keeps_the_reference(case):
    make, op = LAYOUT_CASES[case]
    lin = quantized_linear(type(make())(**{**make().__dict__, "kernel_preference": qk.KernelPreference.REFERENCE}))
    log = OpLog()
    with torch.no_grad(), log:
        lin(_act(2, 96, torch.float32))
    assert op not in log.ops


@pytest.mark.parametrize("double_quant", [False, True], ids=["nf4", "nf4_dq"])
def test_qlora_gradients_reach_input_bias_and_adapter(double_quant):
    # Frozen NF4 base + trainable low-rank adapter: gradients equal those of the dequantized float weight.
    lin = quantized_linear(qk.NF4WeightOnlyConfig(block_size=32, double_quant=double_quant))
    w = lin.weight.dequantize()
    a = torch.randn(4, 96, generator=gen(5), requires_grad=True)
    x = _act(3, 96, torch.float32).requires_grad_()
    out = lin(x) + (x @ a.t()).sum(-1, keepdim=True)
    out.square().sum().backward()
    x2, a2, b2 = x.detach().clone().requires_grad_(), a.detach().clone().requires_grad_(), lin.bias.detach().clone()
    b2.requires_grad_()
    (F.linear(x2, w, b2) + (x2 @ a2.t()).sum(-1, keepdim=True)).square().sum().backward()
    for got, want in ((x.grad, x2.grad), (a.grad, a2.grad), (lin.bias.grad, b2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["nf4_dq", "fp8_row", "int3_g32"])
def test_compile_fullgraph_calls_the_custom_op(case):
    make, op = LAYOUT_CASES[case]
    assert_compiled_calls_op(quantized_linear(make()), _act(4, 96, torch.float32), op)
