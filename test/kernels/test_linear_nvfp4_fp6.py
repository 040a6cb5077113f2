"""torchqkit::linear_nvfp4wo and linear_fp6wo: the C++ CPU kernels (csrc/cpu/linear_lowbit*.cpp) on the layouts'
own bytes against F.linear(x, w.dequantize()) under every ISA level this CPU runs; every code in every decode lane;
opcheck; routing from the configs; torch.compile."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q

from cpu_kernel_testing import OpLog, assert_compiled_calls_op, assert_every_token_count, assert_rel, cpu_levels, gen
from cpu_kernel_testing import isa_param as isa_param_for
from cpu_kernel_testing import needs_kernel, quantized_linear, running_level
from torchqkit import kernels

NVFP4 = torch.ops.torchqkit.linear_nvfp4wo
FP6 = torch.ops.torchqkit.linear_fp6wo
LEVELS = cpu_levels("torchqkit::linear_nvfp4wo", with_avx512_bf16=True)
needs_ext = needs_kernel(LEVELS)
isa_param = isa_param_for(LEVELS)
# Kernel vs reference on the same bytes: both decode to the same float32 weights (NVFP4: level * (E / G), the
# quotient computed once per scale by both; FP6: an exact fp16 value times 2^12 / 2^14 times the scale), summed in a
# different order: ~K * 2^-24 relative, budget 2e-5 of max |ref|. bf16 / fp16 outputs: 2 output ulps (as
# test_linear_lowbit.py).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=gen(seed)) * 0.05


def _nvfp4(n, k):
    return qk.quantize_weight(_w(n, k), Q.fp4_e2m1, qk.PerGroup(16), qk.NVFP4Layout(), scale_dtype=torch.float32,
                              scale_rounding="float8_e4m3")


def _fp6(n, k, qdtype, granularity, dtype=torch.float32):
    return qk.quantize_weight(_w(n, k).to(dtype), qdtype, granularity, qk.FP6Layout())


def _call(w, x, bias):
    if isinstance(w.qlayout, qk.NVFP4Layout):
        return NVFP4(x, w.qdata, w.scale, w.global_scale, bias)
    return FP6(x, w.qdata, w.scale, 3 if w.qdtype is Q.fp6_e3m2 else 2, bias)


def _reference(w, x, bias):
    # the weight in float32, as the op decodes it (a bf16 weight's dequantize() would round level * scale to bf16)
    return F.linear(x.float(), w.dequantize(torch.float32), None if bias is None else bias.float()).to(x.dtype)


WEIGHTS = {
    "nvfp4_K16_one_block": lambda: _nvfp4(9, 16),
    "nvfp4_K1088": lambda: _nvfp4(37, 1088),
    "nvfp4_K80_N5": lambda: _nvfp4(5, 80),  # K not a multiple of 32: a half step at the end
    "fp6_e3m2_row": lambda: _fp6(21, 96, Q.fp6_e3m2, qk.PerRow()),
    "fp6_e3m2_row_K100": lambda: _fp6(13, 100, Q.fp6_e3m2, qk.PerRow()),  # a partial last step
    "fp6_e2m3_g32": lambda: _fp6(19, 1088, Q.fp6_e2m3, qk.PerGroup(32)),
    "fp6_e2m3_g16": lambda: _fp6(11, 64, Q.fp6_e2m3, qk.PerGroup(16)),  # groups of half a step: per-lane scales
    "fp6_e3m2_g64_bf16_scales": lambda: _fp6(7, 192, Q.fp6_e3m2, qk.PerGroup(64), torch.bfloat16),
}


@pytest.fixture(scope="module")
def weights():
    return {name: make() for name, make in WEIGHTS.items()}


@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 3, 5, 9, 17, 70])  # dot kernel (FP6 to 4, NVFP4 never), fp32 blocks, panels
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_kernel_matches_dequantized_reference(monkeypatch, weights, isa, m, name):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = weights[name]
    n, k = w.shape
    bias = torch.randn(n, generator=gen(2))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(m, k, generator=gen(m)) * 3).to(dtype)
        b = bias.to(dtype) if dtype != torch.float16 else None
        assert_rel(_call(w, x, b), _reference(w, x, b), TOL[dtype], f"{isa} {name} M={m} {dtype}")


def _one_hot_outputs(call, k):
    """(N, K): column k is the op's output for the one-hot activation e_k, i.e. the weight the kernel decoded."""
    return call(torch.eye(k)).t().contiguous()


@needs_ext
@isa_param
@pytest.mark.parametrize("qdtype", [Q.fp6_e3m2, Q.fp6_e2m3], ids=lambda q: q.name)
def test_fp6_every_code_in_every_decode_lane(monkeypatch, isa, qdtype):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    codes = (torch.arange(64).reshape(64, 1) + torch.arange(32).reshape(1, 32)) % 64  # row n, position k
    from torchqkit.kernels.ops.linear_intxwo import pack_intx_fields
    qdata = pack_intx_fields(codes.to(torch.uint8), 6)
    ebits = 3 if qdtype is Q.fp6_e3m2 else 2
    out = _one_hot_outputs(lambda x: FP6(x, qdata, torch.ones(64, 1), ebits, None), 32)
    torch.testing.assert_close(out, torch.tensor(qdtype.levels)[codes], rtol=0, atol=0)


@needs_ext
@isa_param
def test_nvfp4_every_scale_byte_and_code(monkeypatch, isa):
    # Every positive e4m3 scale byte (subnormals 0x01..0x07 included, NaN 0x7F left out) over every e2m1 code, with a
    # global scale that is not a power of two (an imported checkpoint's): the kernel's weight is level * (E / G).
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    n, k = 126, 32
    scale_bytes = torch.arange(1, 127, dtype=torch.uint8).reshape(n, 1).expand(n, 2).contiguous()
    codes = (torch.arange(n).reshape(n, 1) + torch.arange(k).reshape(1, k)) % 16
    qdata = (codes[:, 1::2] << 4 | codes[:, 0::2]).to(torch.uint8)
    scale, g = scale_bytes.view(torch.float8_e4m3fn), torch.tensor([3.7])
    out = _one_hot_outputs(lambda x: NVFP4(x, qdata, scale, g, None), k)
    expected = torch.tensor(Q.fp4_e2m1.levels)[codes] * (scale.float() / g).repeat_interleave(16, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["nvfp4_K80_N5", "fp6_e3m2_row_K100", "fp6_e2m3_g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(weights, name, dtype):
    w = weights[name]
    n, k = w.shape
    x = (torch.randn(3, k, generator=gen(1))).to(dtype).reshape(1, 3, k)
    bias = torch.randn(n, generator=gen(2)).to(dtype)
    if name.startswith("nvfp4"):
        op, args = NVFP4, (x, w.qdata, w.scale, w.global_scale, bias)
        # SchemaCheckMode compares float8 inputs with allclose, which float8 lacks: that one check is left out.
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    else:
        op, args = FP6, (x, w.qdata, w.scale, 3 if w.qdtype is Q.fp6_e3m2 else 2, bias)
        utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=list(utils))


def test_nvfp4_activations_run_the_weight_only_kernel_on_fake_quantized_inputs():
    # Note [Activations fake-quantized before a weight-only kernel]
    lin = quantized_linear(qk.NVFP4DynamicActivationNVFP4WeightConfig())
    x = torch.randn(4, 96, generator=gen(6))
    log = OpLog()
    with torch.no_grad(), log:
        out = lin(x)
    assert "linear_nvfp4wo" in log.ops
    act = qk.ActivationQuantSpec(Q.fp4_e2m1, qk.PerGroup(16))
    ref = F.linear(act.fake_quantize(x), lin.weight.dequantize(), lin.bias)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("make, op", [(lambda: qk.NVFP4WeightOnlyConfig(), "linear_nvfp4wo"),
                                      (lambda: qk.FP6WeightOnlyConfig(ebits=2, group_size=32), "linear_fp6wo")],
                         ids=["nvfp4", "fp6_e2m3_g32"])
def test_compile_fullgraph_calls_the_custom_op(make, op):
    assert_compiled_calls_op(quantized_linear(make()), torch.randn(4, 96, generator=gen(7)), op)


@needs_ext
@isa_param
@pytest.mark.parametrize("name", ["nvfp4_K80_N5", "nvfp4_K1088", "fp6_e2m3_g16"])
def test_half_step_groups_in_the_dot_kernel_every_token_count(monkeypatch, weights, isa, name):
    # Note [Groups of half a step]: 1..9 tokens (AVX-512 tiles of 4, AVX2 of 2; the fp32 blocks from 9 on), K an odd
    # multiple of 16 (a last step whose second half has no group), N odd (a short last tile of rows).
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    assert_every_token_count(_call, _reference, weights[name], TOL, f"{isa} {name}")


@needs_ext
@pytest.mark.parametrize("op", ["torchqkit::linear_nvfp4wo", "torchqkit::linear_fp6wo"])
def test_cpu_kernel_registered_and_reported(monkeypatch, op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
    # NVFP4 has no bf16 kernel: at the avx512_bf16 / amx levels its AVX-512 VNNI kernel runs, and status() says so
    levels = LEVELS if op.endswith("fp6wo") else [lv for lv in LEVELS if lv not in ("avx512_bf16", "amx")]
    assert kernels.cpu_backend(op)[0] == f"cpp {running_level(levels)}"
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", "scalar")
    assert kernels.cpu_backend(op)[0] == "cpp scalar"
