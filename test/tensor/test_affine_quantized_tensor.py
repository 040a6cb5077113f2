"""AffineQuantizedTensor behaviour that isn't layout-specific: repr, dispatch traces, errors, cache key."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from test.common import OpLog


def _w(shape=(16, 64)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))




def _trace(fn):
    log = OpLog()
    with log:
        fn()
    return log.ops


def test_repr_is_pinned():
    aqt = qk.quantize_weight(_w(), Q.uint4, qk.PerGroup(32), qk.PlainLayout(), mapping="asymmetric",
                             zero_point_domain="float")
    assert_expected_inline(repr(aqt), """AffineQuantizedTensor(qdtype=uint4, block_size=(1, 32), layout=PlainLayout(), shape=(16, 64), dtype=torch.float32, act_quant=None, kernel=auto)""")
    act = qk.ActivationQuantSpec(Q.int8, qk.PerToken(), "asymmetric")
    aqt = qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout(), act_quant=act,
                             kernel_preference=qk.KernelPreference.REFERENCE)
    assert_expected_inline(repr(aqt.t()), """AffineQuantizedTensor(qdtype=int8, block_size=(1, 64), layout=PlainLayout(), shape=(64, 16), dtype=torch.float32, act_quant='int8 PerToken asymmetric dynamic', kernel=reference, transposed=True)""")


def test_int8_dynamic_linear_runs_the_integer_op_not_a_float_matmul():
    act = qk.ActivationQuantSpec(Q.int8, qk.PerToken())
    aqt = qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout(), act_quant=act)
    x = torch.randn(3, 64)
    ops = _trace(lambda: F.linear(x, aqt))
    assert ops == ["linear_int8da_int8_plain"]


def test_reference_preference_runs_dequantize_then_float_matmul():
    act = qk.ActivationQuantSpec(Q.int8, qk.PerToken())
    aqt = qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout(), act_quant=act,
                             kernel_preference="reference")
    x = torch.randn(3, 64)
    ops = _trace(lambda: F.linear(x, aqt))
    assert "_int_mm" not in ops and ("mm" in ops or "addmm" in ops)
    fast = qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout(), act_quant=act)
    # Exact int32 accumulation vs float32 sums of the same fake-quantized values.
    torch.testing.assert_close(F.linear(x, aqt), F.linear(x, fast), rtol=1e-5, atol=1e-5)


def test_float8_dynamic_linear_runs_the_float8_kernel_on_cpu():
    """float8 x float8 on a CPU: the activation fake-quantized in C++, then linear_fp8wo (torch's CPU _scaled_mm is a
    reference implementation; layouts/scaled_mm.py)."""
    act = qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow())
    aqt = qk.quantize_weight(_w(), Q.float8_e4m3fn, qk.PerRow(), qk.PlainLayout(), act_quant=act,
                             scale_dtype=torch.float32)
    ops = _trace(lambda: F.linear(torch.randn(3, 64), aqt))
    assert "linear_fp8wo" in ops and "fake_quantize_activation" in ops and "_scaled_mm" not in ops


def test_unsupported_op_names_op_layout_and_way_out():
    aqt = qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout())
    try:
        torch.exp(aqt)
    except NotImplementedError as e:
        msg = str(e)
    assert "aten::exp" in msg and "PlainLayout()" in msg and ".dequantize()" in msg


def test_stable_hash_differs_across_formats_and_orientation():
    a = qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout())
    b = qk.quantize_weight(_w(), Q.int8, qk.PerGroup(32), qk.PlainLayout())
    hashes = {a._stable_hash_for_caching(), b._stable_hash_for_caching(), a.t()._stable_hash_for_caching()}
    assert len(hashes) == 3
    assert a._stable_hash_for_caching() == qk.quantize_weight(_w(), Q.int8, qk.PerRow(), qk.PlainLayout())._stable_hash_for_caching()


def test_flatten_unflatten_roundtrip():
    aqt = qk.quantize_weight(_w(), Q.int4, qk.PerGroup(16), qk.PlainLayout(), mapping="asymmetric")
    names, ctx = aqt.__tensor_flatten__()
    assert names == ["qdata", "scale", "zero_point"]
    rebuilt = type(aqt).__tensor_unflatten__({n: getattr(aqt, n) for n in names}, ctx, aqt.shape, aqt.stride())
    torch.testing.assert_close(rebuilt.dequantize(), aqt.dequantize(), rtol=0, atol=0)


def test_module_to_dtype_and_device_keeps_quantization():
    lin = torch.nn.Linear(64, 16)
    qk.quantize_(lin, qk.Int8WeightOnlyConfig())
    before = lin.weight.dequantize()
    lin.to(torch.bfloat16)
    assert isinstance(lin.weight, qk.AffineQuantizedTensor) and lin.weight.dtype == torch.bfloat16
    torch.testing.assert_close(lin.weight.dequantize().float(), before.bfloat16().float(), rtol=0, atol=0)
    assert lin(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    lin.to("cpu")
    assert isinstance(lin.weight, qk.AffineQuantizedTensor)
