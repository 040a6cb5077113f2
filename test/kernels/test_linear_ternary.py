"""torchqkit::linear_ternarywo: the C++ CPU table-lookup kernel (csrc/cpu/linear_ternary.cpp) on
PackedIntxLayout(ternary=True)'s bit planes against F.linear(x, w.dequantize()) under every ISA level this CPU runs;
every 4-code pattern; opcheck; routing from the config; torch.compile."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.kernels.ops.linear_ternarywo import ternary_codes

from cpu_kernel_testing import OpLog, assert_compiled_calls_op, assert_every_token_count, assert_rel, cpu_levels, gen
from cpu_kernel_testing import isa_param as isa_param_for
from cpu_kernel_testing import needs_kernel, quantized_linear

OP = torch.ops.torchqkit.linear_ternarywo
LEVELS = cpu_levels("torchqkit::linear_ternarywo")
needs_ext = needs_kernel(LEVELS)
isa_param = isa_param_for(LEVELS)
# The kernel sums table entries (sums of up to 4 activations) in another order than F.linear: ~K * 2^-24 relative,
# budget 2e-5 of max |ref|; bf16 / fp16 outputs: 2 output ulps (as the other kernel tests).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _ternary(n, k, granularity, seed=0):
    codes = torch.randint(-1, 2, (n, k), generator=gen(seed)).float()
    scales = torch.rand(n, 1, generator=gen(seed + 1)) + 0.5  # per-row magnitudes, like a trained BitNet layer
    return qk.quantize_weight(codes * scales * 0.02, Q.int2, granularity, qk.PackedIntxLayout(ternary=True),
                              mapping="symmetric_no_clipping_err")


WEIGHTS = {  # the lookup kernels: K and the group a multiple of 16; else the row-at-a-time loop
    "g32_N37": lambda: _ternary(37, 256, qk.PerGroup(32)),      # 2 full blocks of 16 rows and 5 rows
    "g16_N16": lambda: _ternary(16, 96, qk.PerGroup(16)),       # a group per step
    "g128_N33_K1024": lambda: _ternary(33, 1024, qk.PerGroup(128)),  # more than 16 groups: two scale loads
    "row_N20_K272": lambda: _ternary(20, 272, qk.PerRow()),     # 17 steps: a second, partial word load
    "g8_N9": lambda: _ternary(9, 64, qk.PerGroup(8)),           # groups of 8: the row loop
    "row_N7_K100": lambda: _ternary(7, 100, qk.PerRow()),       # K not a multiple of 8: padded planes
}


@pytest.fixture(scope="module")
def weights():
    return {name: make() for name, make in WEIGHTS.items()}


def _call(w, x, bias):
    return OP(x, w.qdata, w.scale, bias)


def _reference(w, x, bias):
    return F.linear(x.float(), w.dequantize(torch.float32), None if bias is None else bias.float()).to(x.dtype)


@needs_ext
@isa_param
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_kernel_matches_dequantized_reference_every_token_count(monkeypatch, weights, isa, name):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    # 1..9 tokens: every token count of the lookup kernels (1..8) and the first of the dequantized prefill
    assert_every_token_count(_call, _reference, weights[name], TOL, f"{isa} {name}")


@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 5, 40])
def test_float16_activations_and_no_bias(monkeypatch, weights, isa, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = weights["g32_N37"]
    x = torch.randn(2, m, w.shape[1], generator=gen(m)).to(torch.float16)  # a leading batch dim too
    assert_rel(_call(w, x, None), _reference(w, x, None), TOL[torch.float16], f"{isa} M={m}")


@needs_ext
@isa_param
def test_every_four_code_pattern_in_every_lane(monkeypatch, isa):
    # 81 patterns of 4 codes in {-1, 0, 1}, each in every row position (lane) and nibble: with one-hot activations
    # the output is the weight the kernel read, which must be exactly code * scale.
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    patterns = torch.cartesian_prod(*[torch.tensor([-1, 0, 1])] * 4)  # (81, 4)
    n, k = 32, 128
    idx = (torch.arange(n).reshape(n, 1) * 7 + torch.arange(k // 4).reshape(1, k // 4)) % 81
    codes = patterns[idx].reshape(n, k).float()
    scales = torch.arange(1, n + 1, dtype=torch.float32).reshape(n, 1) / 8
    w = qk.quantize_weight(codes * scales, Q.int2, qk.PerGroup(32), qk.PackedIntxLayout(ternary=True),
                           mapping="symmetric_no_clipping_err")
    assert torch.equal(ternary_codes(w.qdata, k).float(), codes)
    out = OP(torch.eye(k), w.qdata, w.scale, None).t()
    torch.testing.assert_close(out, codes * scales, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(weights, dtype):
    w = weights["g32_N37"]
    x = torch.randn(1, 3, w.shape[1], generator=gen(1)).to(dtype)
    bias = torch.randn(w.shape[0], generator=gen(2)).to(dtype)
    torch.library.opcheck(OP, (x, w.qdata, w.scale, bias),
                          test_utils=["test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"])


@needs_ext
def test_the_ternary_config_routes_to_the_kernel_and_int2_does_not():
    lin = quantized_linear(qk.presets.get("ternary-g32"))
    x = torch.randn(4, 96, generator=gen(6))
    log = OpLog()
    with torch.no_grad(), log:
        out = lin(x)
    assert "linear_ternarywo" in log.ops and "linear_intxwo" not in log.ops
    assert_rel(out, F.linear(x, lin.weight.dequantize(), lin.bias), 2e-5, "ternary-g32 Linear")
    plain = quantized_linear(qk.IntxWeightOnlyConfig(bits=2, granularity=qk.PerGroup(32)))
    with torch.no_grad(), OpLog() as log2:
        plain(x)
    assert "linear_intxwo" in log2.ops and "linear_ternarywo" not in log2.ops


def test_compile_fullgraph_calls_the_custom_op():
    assert_compiled_calls_op(quantized_linear(qk.presets.get("ternary-g32")), torch.randn(4, 96, generator=gen(7)),
                             "linear_ternarywo")


def test_bad_planes_name_the_op_and_shapes():
    w = _ternary(8, 64, qk.PerGroup(32))
    with pytest.raises(RuntimeError, match=r"linear_ternarywo: planes must be \(N, 2 \* ceil\(K / 8\)\)"):
        OP(torch.randn(1, 72), w.qdata, w.scale, None)
