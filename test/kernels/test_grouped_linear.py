"""torchqkit::grouped_linear_<format>: the C++ CPU loop over a stack's experts (csrc/cpu/grouped_rows.h) against
its reference (each expert's 2-d reference op) at every ISA level this CPU runs, and bit for bit against the 2-d
C++ op called per expert; group ends with empty groups and rows past the last end; bad group ends refused; opcheck;
the MoE entry points (torch._grouped_mm, w[ids] + bmm) take one grouped op call per stack."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.api.expert_weights import quantize_experts
from torchqkit.kernels.ops import grouped_linear as ops
from torchqkit.kernels.ops import fake_quantize_activation as fake_quantize_op
from torchqkit.core import qdtypes as Q
from torchqkit.layouts.routes import fake_quantized_input, route_for
from torchqkit.tensor.experts import stack_experts

from cpu_kernel_testing import assert_rel, cpu_levels, gen, isa_param, needs_kernel

E, N, K = 4, 40, 96  # K = 96: the int4 tiles pad it to 128 (whole chunks), three groups of 32
LEVELS = cpu_levels("torchqkit::grouped_linear_int4wo_tiled", with_avx_vnni=True, with_avx512_bf16=True)
needs_ext = needs_kernel(LEVELS)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -7}  # the 2-d ops' kernel tests' budgets

CONFIGS = {
    "int4_g32": qk.Int4WeightOnlyConfig(group_size=32),
    "int8_row": qk.Int8WeightOnlyConfig(),
    "int8_g32": qk.Int8WeightOnlyConfig(group_size=32),
    "int8_dyn": qk.Int8DynamicActivationInt8WeightConfig(),
    "mxfp4": qk.MXFP4WeightOnlyConfig(),
    "mxfp8": qk.MXFP8WeightOnlyConfig(),
    "fp8_row": qk.Float8WeightOnlyConfig(),
    "fp8_block": qk.Float8WeightOnlyConfig(granularity=qk.PerBlock((32, 32))),  # N = 40: rows padded to 64
    "nf4": qk.NF4WeightOnlyConfig(),
    "nf4_double": qk.NF4WeightOnlyConfig(double_quant=True),
    "int3_asym": qk.IntxWeightOnlyConfig(bits=3),
    "nvfp4": qk.NVFP4WeightOnlyConfig(),
    "fp6_e3m2": qk.FP6WeightOnlyConfig(ebits=3),
    "ternary": qk.presets.get("ternary-g32"),
    "w4a8": qk.Int8DynamicActivationIntxWeightConfig(),
    # int4 activation codes on the int8 x int4 grouped op; the others: Note [Activations fake-quantized before a
    # weight-only kernel], the weight-only grouped op on the fake-quantized input
    "w4a4": qk.Int4DynamicActivationInt4WeightConfig(group_size=32),
    "fp8_int4": qk.Float8DynamicActivationInt4WeightConfig(group_size=32),
    "mxfp8_mxfp4": qk.MXDynamicActivationMXWeightConfig(weight="mxfp4"),
    "nvfp4_nvfp4": qk.NVFP4DynamicActivationNVFP4WeightConfig(),
    "fp8_fp8_row": qk.Float8DynamicActivationFloat8WeightConfig(granularity=qk.PerRow()),
    "fp8_fp8_tensor": qk.Float8DynamicActivationFloat8WeightConfig(),
}
OFFS = {  # (M, group ends)
    "empty_groups": (7, [2, 2, 7, 7]),
    "one_row_last_expert": (1, [0, 0, 0, 1]),
    "rows_past_the_end": (8, [1, 3, 5, 6]),  # rows 6, 7: zeros (expert-parallel sentinels)
    "no_rows": (5, [0, 0, 0, 0]),
}


@pytest.fixture(scope="module")
def stacks():
    w = torch.randn(E, N, K, generator=gen(0))
    return {name: quantize_experts(config, w, "experts") for name, config in CONFIGS.items()}


def _route(stack, x):
    route = route_for(stack[0], x)
    assert route is not None and route.grouped is not None, stack
    return route.grouped


def _grouped(stack, x, offs, reference=False):
    """The stack's grouped op as the layout's route calls it (its reference: the grouped op's reference)."""
    grouped = _route(stack, x)
    fn = getattr(ops, grouped.op.split("::")[1] + "_ref") if reference else grouped.dispatched_op
    return grouped.call(fn, stack.inner_tensors(), stack[0], x, offs)


def _tol(name, dtype):
    return 1e-2 if name in ("int8_dyn", "w4a8") else TOL[dtype]  # int8 activations: a code may round the other way


@needs_ext
@isa_param(LEVELS)
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("case", OFFS)
def test_kernel_matches_reference(monkeypatch, stacks, isa, name, case):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    m, ends = OFFS[case]
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(m, K, generator=gen(m)) * 3).to(dtype)
        offs = torch.tensor(ends, dtype=torch.int32 if dtype == torch.bfloat16 else torch.int64)
        out = _grouped(stacks[name], x, offs)
        ref = _grouped(stacks[name], x, offs, reference=True)
        assert_rel(out, ref, _tol(name, dtype), f"{isa} {name} {case} {dtype}")
        assert torch.equal(out[ends[-1]:], torch.zeros_like(out[ends[-1]:]))


@needs_ext
@pytest.mark.parametrize("name", CONFIGS)
def test_each_expert_is_exactly_its_2d_op(monkeypatch, stacks, name):
    """The loop adds nothing: expert g's rows are what the 2-d op gives on expert g's view, bit for bit."""
    monkeypatch.setenv("TORCHQKIT_CPU_ROUTES", "rules")  # both calls on the same kernels
    stack, (m, ends) = stacks[name], OFFS["empty_groups"]
    x = torch.randn(m, K, generator=gen(3))
    out = _grouped(stack, x, torch.tensor(ends))
    with torch.no_grad():
        for g, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            if end > start:
                assert torch.equal(out[start:end], torch.nn.functional.linear(x[start:end], stack[g])), (name, g)


@needs_ext
@pytest.mark.parametrize("threads", [1, 2])
def test_experts_side_by_side_under_inference_mode(stacks, threads):
    """A decode step (a row per expert, as many experts as threads): the experts run one per thread (Note [Decoding
    experts side by side]); the pool's threads take the caller's inference mode, so writing the result works
    there, and the numbers are the sequential loop's."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(4, K, generator=gen(7))
        offs = torch.tensor([1, 2, 3, 4])
        for name, stack in stacks.items():
            with torch.inference_mode():
                out = _grouped(stack, x, offs)
            assert out.is_inference()
            assert_rel(out, _grouped(stack, x, offs, reference=True), _tol(name, torch.float32), name)
    finally:
        torch.set_num_threads(before)


@needs_ext
def test_experts_side_by_side_measure_their_routes_on_one_thread(monkeypatch):
    """Note [Routes chosen by measurement]: a case is keyed by the threads its kernel runs on; an expert run side by
    side runs on one, whatever torch's thread count."""
    monkeypatch.setenv("TORCHQKIT_CPU_ROUTES", "measure")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        qk.kernels.clear_routes()
        # K = 256: inner_k_tiles 8, where one token has two exact routes (K = 96 tiles by 2: one route)
        stack = quantize_experts(CONFIGS["int4_g32"], torch.randn(E, 64, 256, generator=gen(8)), "experts")
        _grouped(stack, torch.randn(4, 256, generator=gen(9)), torch.tensor([1, 2, 3, 4]))
        threads = {r["threads"] for r in qk.kernels.routes() if r["op"] == "torchqkit::linear_int4wo_tiled"}
        # the levels with two int4 decode routes (float, int16 pairs) measure them; the others have one to take
        measured = torch.ops.torchqkit_cpu.isa() in ("avx_vnni", "avx512_vnni", "avx512_bf16", "amx")
        assert threads == ({1} if measured else set()), threads
    finally:
        torch.set_num_threads(before)
        qk.kernels.clear_routes()


@needs_ext
@pytest.mark.parametrize("ends, message", [
    ([3, 2, 7, 7], r"non-decreasing and at most the 7 rows of x; offs\[1\] = 2"),
    ([2, 2, 7, 9], r"at most the 7 rows of x; offs\[3\] = 9"),
])
def test_bad_group_ends_are_refused(stacks, ends, message):
    x = torch.randn(7, K, generator=gen(4))
    for reference in (False, True):
        with pytest.raises(RuntimeError, match=message):
            _grouped(stacks["int8_row"], x, torch.tensor(ends), reference)


@needs_ext
def test_bad_shapes_are_refused(stacks):
    s = stacks["int8_row"]
    with pytest.raises(RuntimeError, match=r"offs must be 4 int64 / int32 group ends \(one per expert\)"):
        torch.ops.torchqkit.grouped_linear_int8wo_plain(torch.randn(2, K), torch.tensor([1, 2]), s.qdata, s.scale)
    with pytest.raises(RuntimeError, match=r"qdata \(E, N, K\) and scale \(E, N\[, groups\]\) of the same E experts"):
        torch.ops.torchqkit.grouped_linear_int8wo_plain(torch.randn(2, K), torch.tensor([0, 0, 1, 2]), s.qdata,
                                                        s.scale[:3])
    q = stacks["int4_g32"]
    with pytest.raises(RuntimeError, match=r"qdata \(E, N8/8, Kt/\(16T\), 32, T/2\) and scale_and_zero"):
        torch.ops.torchqkit.grouped_linear_int4wo_tiled(torch.randn(2, 128), torch.tensor([0, 0, 1, 2]), q.qdata[0],
                                                        q.scale_and_zero, 32, N)
    m = stacks["mxfp4"]
    with pytest.raises(RuntimeError, match=r"qdata \(E, \.\.\.\) of 3 dims and scale \(E, \.\.\.\) of the same E"):
        torch.ops.torchqkit.grouped_linear_mxwo(torch.randn(2, K), torch.tensor([0, 0, 1, 2]), m.qdata[0], m.scale)


@pytest.mark.parametrize("name", CONFIGS)
def test_opcheck(stacks, name):
    stack, x = stacks[name], torch.randn(7, K, generator=gen(5))
    grouped = _route(stack, x)
    op = grouped.dispatched_op

    # torch's SchemaCheckMode compares inputs before / after with allclose, which float8 tensors lack: ops on float8
    # codes or scales skip that one check (as the 2-d ops' opcheck does)
    float8 = any(t is not None and t.dtype.is_floating_point and t.dtype.itemsize == 1
                 for t in stack.inner_tensors().values())
    utils = [u for u in ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
             if not (float8 and u == "test_schema")]

    def check(*args):
        torch.library.opcheck(op, args, test_utils=utils)
        return op(*args)

    grouped.call(check, stack.inner_tensors(), stack[0], x, torch.tensor([2, 2, 7, 7]))


@needs_ext
@pytest.mark.parametrize("name", CONFIGS)
def test_moe_entry_points_take_one_grouped_call_per_stack(stacks, name):
    """torch._grouped_mm and w[ids] + bmm (transformers' grouped_mm / batched_mm experts) reach the grouped op
    once, with the same numbers as each expert's own linear."""
    stack = stacks[name]
    op = _route(stack, torch.randn(1, K)).op.split("::")[1]
    x = torch.randn(7, K, generator=gen(6))
    w = stack.dequantize()
    for call in (lambda: torch._grouped_mm(x, stack.transpose(-2, -1), offs=torch.tensor([2, 2, 7, 7])),
                 lambda: torch.bmm(x[:4].unsqueeze(1), stack[torch.tensor([3, 0, 3, 1])].transpose(-2, -1))[:, 0]):
        with torch.no_grad(), torch.profiler.profile() as prof:  # sees ops called inside other ops, unlike a mode
            out = call()
        calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("torchqkit::")}
        expected = {f"torchqkit::{op}": 1}
        if stack.act_quant is not None and fake_quantize_op.takes(stack.act_quant):  # float8 / NVFP4 activations
            expected["torchqkit::fake_quantize_activation"] = 1
        assert calls == expected, calls
        xq = fake_quantized_input(stack[0], x)  # activation specs here are per token: the same for any rows
        if out.shape[0] == 7:
            ref = torch.cat([xq[:2] @ w[0].T, xq[2:7] @ w[2].T])
        else:
            ref = torch.stack([xq[i] @ w[e].T for i, e in enumerate([3, 0, 3, 1])])
        assert_rel(out, ref, _tol(name, torch.float32), name)


@needs_ext
def test_per_tensor_activation_scales_are_taken_per_expert():
    """A dynamic per-tensor activation scale spans the rows one expert's linear sees, not the whole sorted input:
    the grouped op's rows equal each expert's own 2-d linear."""
    act = qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerTensor())
    w = torch.randn(E, N, K, generator=gen(10))
    stack = stack_experts([qk.quantize_weight(w[e], Q.int4, qk.PerGroup(32), qk.PackedIntxLayout(),
                                              mapping="symmetric", act_quant=act) for e in range(E)], "experts")
    m, ends = OFFS["empty_groups"]
    x = torch.randn(m, K, generator=gen(11))
    x[0] *= 100  # expert 0's rows: a scale 100x the others'
    out = _grouped(stack, x, torch.tensor(ends))
    with torch.no_grad():
        for g, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            if end > start:
                ref = torch.nn.functional.linear(x[start:end], stack[g])
                assert_rel(out[start:end], ref, TOL[torch.float32], g)
    # the case matters: one scale over the whole input would quantize expert 2's rows otherwise
    assert not torch.equal(act.fake_quantize(x)[2:7], act.fake_quantize(x[2:7]))
