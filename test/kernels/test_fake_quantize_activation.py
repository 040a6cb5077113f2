"""torchqkit::fake_quantize_activation: the C++ CPU kernel (csrc/cpu/fake_quantize_activation.cpp) gives the
ActivationQuantSpec's fake quantization bit for bit at every ISA level, for every float8 / MXFP8 / NVFP4 spec and
input dtype, on values that reach every rounding branch (float8 subnormals, e2m1 ties, saturation, NaN / Inf rows);
the routes of the activation configs call it; bad arguments raise."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.kernels.ops.fake_quantize_activation import fake_quantize_activation_ref, op_arguments, takes

from cpu_kernel_testing import cpu_levels, gen, isa_param, needs_kernel

OP = torch.ops.torchqkit.fake_quantize_activation
LEVELS = cpu_levels("torchqkit::fake_quantize_activation")

SPECS = {
    "e4m3-token": qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerToken()),
    "e4m3-tensor": qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerTensor()),
    "e4m3-static": qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerTensor(), static_scale=0.05),
    "e5m2-token": qk.ActivationQuantSpec(Q.float8_e5m2, qk.PerToken()),
    "e4m3fnuz-token": qk.ActivationQuantSpec(Q.float8_e4m3fnuz, qk.PerToken()),
    "e5m2fnuz-tensor": qk.ActivationQuantSpec(Q.float8_e5m2fnuz, qk.PerTensor()),
    "mxfp8-e4m3": qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerGroup(32)),
    "mxfp8-e5m2": qk.ActivationQuantSpec(Q.float8_e5m2, qk.PerGroup(32)),
    "nvfp4": qk.ActivationQuantSpec(Q.fp4_e2m1, qk.PerGroup(16)),
}
DTYPE_MAX = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}


def _inputs(dtype) -> dict[str, torch.Tensor]:
    g = gen(3)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.1, 1.0, 0.0, -0.0, 3.0, 4.5, 5.5])
    mags = 10 ** (torch.rand(6, 4096, generator=g) * 14 - 12)  # 14 decades in a row: float8's subnormals too
    signed = torch.where(torch.rand(6, 4096, generator=g) < 0.5, -mags, mags)
    special = torch.randn(6, 64, generator=g)
    special[1, 3], special[2, 5], special[4, 0] = float("nan"), float("inf"), -float("inf")
    special[3], special[5] = 0.0, -0.0
    xs = {
        "decode": torch.randn(1, 4096, generator=g) * 3,
        "odd-k": torch.randn(3, 40, generator=g),  # partial groups of 32 and vector tails
        "k17": torch.randn(2, 17, generator=g),
        "ties": torch.cat([ties, -ties]).reshape(2, 16) * torch.tensor([[1.0], [6.0]]),  # e2m1 and float8 ties
        "eighths": torch.randint(-60, 60, (3, 64), generator=g).float() / 8,
        "decades": signed,
        "special-rows": special,
        "tiny": torch.randn(4, 64, generator=g) * 1e-40,
        "huge": torch.randn(4, 64, generator=g) * DTYPE_MAX[dtype] / 5,
    }
    return {k: v.to(dtype) for k, v in xs.items()}


def _assert_bits(got: torch.Tensor, want: torch.Tensor, what: str):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = (got == want) & (torch.signbit(got) == torch.signbit(want)) | (got.isnan() & want.isnan())
    if not bool(same.all()):
        r, c = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{what}: [{r}, {c}] {float(want[r, c])!r} expected, got {float(got[r, c])!r}")


@needs_kernel(LEVELS)
@isa_param(LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_gives_the_specs_values_bit_for_bit(monkeypatch, isa, dtype, name):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    spec = SPECS[name]
    for what, x in _inputs(dtype).items():
        _assert_bits(OP(x, *op_arguments(spec)), spec.fake_quantize(x), f"{name} {isa} {dtype} {what}")


@needs_kernel(LEVELS)
@isa_param(LEVELS)
@pytest.mark.parametrize("name", ["e4m3-tensor", "nvfp4", "e4m3-token"])
def test_group_ends_take_each_groups_own_tensor_scale(monkeypatch, isa, name):
    """With group ends (a stack of experts), a per-tensor scale and NVFP4's scale of the block scales come from each
    group's rows; rows past the last end are returned as they are."""
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    spec = SPECS[name]
    x = torch.randn(11, 64, generator=gen(4)) * torch.logspace(-3, 3, 11).unsqueeze(1)  # groups far apart in range
    offs = torch.tensor([2, 2, 6, 9])
    got = OP(x, *op_arguments(spec), offs)
    for lo, hi in [(0, 2), (2, 6), (6, 9)]:
        _assert_bits(got[lo:hi], spec.fake_quantize(x[lo:hi]), f"{name} rows {lo}:{hi}")
    assert torch.equal(got[9:], x[9:])
    _assert_bits(got, fake_quantize_activation_ref(x, *op_arguments(spec), offs), f"{name} reference")


@needs_kernel(LEVELS)
@pytest.mark.parametrize("name", ["e4m3-token", "e4m3-tensor", "mxfp8-e4m3", "nvfp4"])
def test_leading_dims_are_tokens(name):
    """x (B, T, K) as F.linear hands it: the (B T, K) result in x's shape, per-tensor scales over every token."""
    spec = SPECS[name]
    x = torch.randn(2, 5, 64, generator=gen(6)) * torch.logspace(-2, 2, 5).view(1, 5, 1)
    got = OP(x, *op_arguments(spec))
    assert got.shape == x.shape
    _assert_bits(got.reshape(10, 64), spec.fake_quantize(x.reshape(10, 64)), name)
    _assert_bits(fake_quantize_activation_ref(x, *op_arguments(spec)).reshape(10, 64), got.reshape(10, 64), name)


@pytest.mark.parametrize("name", ["e4m3-token", "mxfp8-e4m3", "nvfp4", "e4m3-static"])
def test_opcheck(name):
    x = torch.randn(5, 64, generator=gen(5))
    torch.library.opcheck(OP, (x, *op_arguments(SPECS[name])))
    torch.library.opcheck(OP, (x, *op_arguments(SPECS[name]), torch.tensor([1, 5])))
    torch.library.opcheck(OP, (x.reshape(5, 2, 32), *op_arguments(SPECS[name])))


def test_only_float_formats_are_taken():
    assert all(takes(s) for s in SPECS.values())
    assert not takes(qk.ActivationQuantSpec(Q.int8, qk.PerToken()))
    assert not takes(qk.ActivationQuantSpec(Q.int4, qk.PerToken()))


@needs_kernel(LEVELS)
@pytest.mark.parametrize("args,message", [
    (("int8", 0, False, None), "not one of float8_e4m3fn"),
    (("fp4_e2m1", 32, False, None), "not an activation format"),
    (("float8_e4m3fn", 16, False, None), "not an activation format"),
    (("float8_e4m3fnuz", 32, False, None), "OCP float8"),
    (("float8_e4m3fn", 0, True, -1.0), "finite positive"),
])
def test_bad_arguments_raise(args, message):
    with pytest.raises(ValueError, match=message):
        OP(torch.randn(2, 64), *args)


@needs_kernel(LEVELS)
def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\(\.\.\., features\)"):
        OP(torch.randn(2, 3, 64), "float8_e4m3fn", 0, False, None, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"\(\.\.\., features\)"):
        OP(torch.tensor(1.0), "float8_e4m3fn", 0, False, None)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        OP(torch.randn(2, 64).double(), "float8_e4m3fn", 0, False, None)
    with pytest.raises(ValueError, match="group ends"):
        OP(torch.randn(2, 64), "float8_e4m3fn", 0, True, None, torch.tensor([[1.0]]))


def _torchqkit_calls(fn):
    """fn()'s result and the torchqkit ops it called, with counts (the profiler sees ops called inside others)."""
    with torch.profiler.profile() as prof:
        out = fn()
    return out, {e.key: e.count for e in prof.key_averages() if e.key.startswith("torchqkit::")}


@needs_kernel(LEVELS)
@pytest.mark.parametrize("preset", ["fp8-dyn-int4-g32", "mxfp8-dyn-mxfp4", "nvfp4-dyn-nvfp4"])
def test_activation_configs_call_the_op_and_keep_the_reference_values(preset):
    """A linear under a float8 / MXFP8 / NVFP4 activation config calls the op once (not the spec's torch ops),
    and multiplies the same activation the reference does; training through it keeps the straight-through
    gradient, x's gradient = grad @ W."""
    lin = torch.nn.Linear(96, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 96, generator=gen(0)) * 0.05)
    qk.quantize_(lin, qk.presets.get(preset))
    x = torch.randn(3, 96, generator=gen(1))
    with torch.no_grad():
        out, calls = _torchqkit_calls(lambda: lin(x))
    assert calls.get("torchqkit::fake_quantize_activation") == 1, calls
    w = lin.weight
    with torch.no_grad():
        ref = torch.nn.functional.linear(w.act_quant.fake_quantize(x), w.dequantize(), lin.bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))  # kernel's sum order
    xg = x.clone().requires_grad_()
    _, calls = _torchqkit_calls(lambda: lin(xg).sum().backward())
    assert calls.get("torchqkit::fake_quantize_activation") == 1, calls
    torch.testing.assert_close(xg.grad, torch.ones(3, 48) @ w.dequantize())
