"""torchqkit::linear_nm_sparse_wo: the C++ CPU kernel (csrc/cpu/linear_nm_sparse.cpp) on NMSparseLayout's kept codes
and positions against F.linear(x, w.dequantize()) under every ISA level this CPU runs, for every zero-point domain,
code width and pattern the layout stores; every 2:4 position pair in every lane; opcheck; routing; torch.compile."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.core.primitives import MappingType
from torchqkit.kernels.ops.linear_nm_sparse_wo import nm_sparse_weight
from torchqkit.layouts.nm_sparse import _nm_sparse_call

from cpu_kernel_testing import OpLog, assert_compiled_calls_op, assert_every_token_count, assert_rel, cpu_levels, gen
from cpu_kernel_testing import isa_param as isa_param_for
from cpu_kernel_testing import needs_kernel, quantized_linear

OP = torch.ops.torchqkit.linear_nm_sparse_wo
LEVELS = cpu_levels("torchqkit::linear_nm_sparse_wo")
needs_ext = needs_kernel(LEVELS)
isa_param = isa_param_for(LEVELS)
# Each kept weight is u * s + b (one FMA) where the oracle computes (c - z) * s, then sums in another order than
# F.linear: a few ulps per term, budget 2e-5 of max |ref|; bf16 / fp16 outputs: 2 output ulps.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _pruned(n, k, config, seed=0):
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen(seed)) * 0.05)
    qk.quantize_(lin, config)
    return lin.weight


def _sparse(base, pattern=(2, 4)):
    return qk.SparsityConfig(pattern=pattern, base=base)


WEIGHTS = {  # the dot kernels: 2:4, 4- or 8-bit codes, groups of whole steps (32 columns AVX-512, 16 AVX2)
    "int4_g32_float_zp_N37": lambda: _pruned(37, 256, _sparse(qk.Int4WeightOnlyConfig(group_size=32))),  # odd row
    "int8_row_N33_K512": lambda: _pruned(33, 512, _sparse(qk.Int8WeightOnlyConfig())),
    "int8_int_zp_g64": lambda: _pruned(16, 256, _sparse(qk.IntxWeightOnlyConfig(
        bits=8, granularity=qk.PerGroup(64), mapping=MappingType.ASYMMETRIC))),
    "uint8_row": lambda: qk.quantize_weight(torch.randn(24, 320, generator=gen(3)), Q.uint8, qk.PerRow(),
                                            qk.NMSparseLayout(2, 4)),
    "int4_sym_g16": lambda: _pruned(20, 192, _sparse(qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(16)))),
    # the entry-at-a-time loop: other widths, patterns, K not a multiple of a step
    "int3_g32": lambda: _pruned(9, 128, _sparse(qk.IntxWeightOnlyConfig(bits=3))),
    "int4_g32_K100": lambda: _pruned(11, 100, _sparse(qk.Int4WeightOnlyConfig(group_size=32))),  # padded to 128
    "int8_row_K40": lambda: _pruned(12, 40, _sparse(qk.Int8WeightOnlyConfig())),
    "int8_4of8": lambda: _pruned(10, 128, _sparse(qk.Int8WeightOnlyConfig(), pattern=(4, 8))),
    "int4_1of4_g32": lambda: _pruned(10, 128, _sparse(qk.IntxWeightOnlyConfig(bits=4, mapping=MappingType.ASYMMETRIC),
                                                      pattern=(1, 4))),
}


@pytest.fixture(scope="module")
def weights():
    return {name: make() for name, make in WEIGHTS.items()}


def _call(w, x, bias):
    return _nm_sparse_call(OP, w, x, bias)


def _reference(w, x, bias):
    return F.linear(x.float(), w.dequantize(torch.float32), None if bias is None else bias.float()).to(x.dtype)


def test_op_reference_decodes_what_the_layout_dequantizes(weights):
    for name, w in weights.items():
        layout = w.qlayout
        k = layout.stored_k(w.weight_format)
        dense = nm_sparse_weight(w.kept, w.positions, w.scale, w.zero_point, layout.n, layout.m, w.qdtype.bits,
                                 w.qdtype.signed, qk.ZeroPointDomain(w.zero_point_domain).value, k)
        # columns past in_features (padding) meet the zeros pad_features appends to x
        assert torch.equal(dense[:, : w.shape[1]], w.dequantize(torch.float32)), name


@needs_ext
@isa_param
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_kernel_matches_dequantized_reference_every_token_count(monkeypatch, weights, isa, name):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    # 1..9 tokens: every token count of the dot kernels (1..8) and the first of the dequantized prefill
    assert_every_token_count(_call, _reference, weights[name], TOL, f"{isa} {name}")


@needs_ext
@isa_param
@pytest.mark.parametrize("m", [1, 5, 40])
def test_float16_activations_and_no_bias(monkeypatch, weights, isa, m):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    w = weights["int4_g32_float_zp_N37"]
    x = torch.randn(2, m, w.shape[1], generator=gen(m)).to(torch.float16)  # a leading batch dim too
    assert_rel(_call(w, x, None), _reference(w, x, None), TOL[torch.float16], f"{isa} M={m}")


@needs_ext
@isa_param
@pytest.mark.parametrize("bits", [4, 8])
def test_every_position_pair_in_every_lane(monkeypatch, isa, bits):
    # The 6 position pairs of a 2:4 block, each in every block of a step (every lane pair), with distinct codes: with
    # one-hot activations each output is the weight the kernel read at that column, which must be exactly
    # the dequantized weight (zeros at the pruned columns).
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    n, k = 12, 128
    dense = torch.zeros(n, k)
    for r in range(n):
        for b in range(k // 4):
            for j, p in enumerate(pairs[(r + b) % 6]):
                dense[r, 4 * b + p] = 1 + (r + 3 * b + j) % 7  # codes 1..7: exact in int4 and int8
    config = qk.IntxWeightOnlyConfig(bits=bits, granularity=qk.PerGroup(32))
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(dense / 8)
    qk.quantize_(lin, _sparse(config))
    w = lin.weight
    assert torch.equal(w.dequantize() != 0, dense != 0)  # the mask is the weight's own nonzeros
    out = _call(w, torch.eye(k), None).t()
    torch.testing.assert_close(out, w.dequantize(torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["int4_g32_float_zp_N37", "int8_int_zp_g64"])
def test_opcheck(weights, dtype, name):
    w = weights[name]
    layout = w.qlayout
    x = torch.randn(1, 3, w.shape[1], generator=gen(1)).to(dtype)
    bias = torch.randn(w.shape[0], generator=gen(2)).to(dtype)
    torch.library.opcheck(OP, (x, w.kept, w.positions, w.scale, w.zero_point, layout.n, layout.m, w.qdtype.bits,
                               w.qdtype.signed, qk.ZeroPointDomain(w.zero_point_domain).value, bias),
                          test_utils=["test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"])


@needs_ext
@pytest.mark.parametrize("preset", ["sparse-2of4-int8", "sparse-2of4-int4-g32"])
def test_integer_sparse_configs_route_to_the_kernel(preset):
    lin = quantized_linear(qk.presets.get(preset))
    x = torch.randn(4, 96, generator=gen(6))
    with torch.no_grad(), OpLog() as log:
        out = lin(x)
    assert "linear_nm_sparse_wo" in log.ops
    assert_rel(out, F.linear(x, lin.weight.dequantize(), lin.bias), 2e-5, preset)


def test_float_values_run_the_declared_reference():
    lin = quantized_linear(qk.presets.get("sparse-2of4"))
    with torch.no_grad(), OpLog() as log:
        lin(torch.randn(2, 96, generator=gen(8)))
    assert "linear_nm_sparse_wo" not in log.ops
    rows = [r for r in qk.kernels.status() if r["layout"] == "nm_sparse"]
    assert any(r["linear"].startswith("float values") and r["path"].startswith("reference") for r in rows), rows
    assert any(r["path"].startswith("torchqkit::linear_nm_sparse_wo") for r in rows), rows


def test_compile_fullgraph_calls_the_custom_op():
    assert_compiled_calls_op(quantized_linear(qk.presets.get("sparse-2of4-int4-g32")),
                             torch.randn(4, 96, generator=gen(7)), "linear_nm_sparse_wo")


def test_bad_positions_name_the_op_and_shapes(weights):
    w = weights["int8_row_N33_K512"]
    with pytest.raises(RuntimeError, match=r"linear_nm_sparse_wo: positions must be \(N, 64\)"):
        OP(torch.randn(1, 512), w.kept, w.positions[:, :10], w.scale, None, 2, 4, 8, True, "none", None)
    with pytest.raises(RuntimeError, match=r"linear_nm_sparse_wo: K = 510 is not a multiple of m = 4"):
        OP(torch.randn(1, 510), w.kept, w.positions, w.scale, None, 2, 4, 8, True, "none", None)
