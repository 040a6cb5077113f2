"""The C++ CUDA kernels (csrc/cuda: int4 tensor-core tiles, NF4 and float8 GEMV) against the reference, through the
layers users call: ``quantize_`` with ``KernelPreference.CUDA`` (a named backend that can't serve raises, so a pass
means the C++ kernel ran), then ``lin(x)`` against ``reference_linear`` (dequantize, then float ``F.linear``).

Shapes cover decode (M = 1, 5: the split-K path) and prefill (M = 16, 17, 256: whole tiles and a ragged last tile),
K that is not a multiple of the group (padded) and N that is not a multiple of the 8 / 64 column tiles; every
activation dtype a kernel takes and every scale dtype a config stores.

Tolerance, relative to the output's largest magnitude: the kernels multiply the dequantized weight rounded to the
activation dtype and accumulate in float32, as the reference's cuBLAS matmul does; only summation order and the
final rounding differ: 2^-8 for float16, 2^-5 for bfloat16 (8-bit mantissa: per-product rounding adds up over K
differently in the two), 1e-5 for float32.
"""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from test.devices import gpu_skip_reason
from torchqkit import kernels
from torchqkit.layouts.routes import reference_linear
from torchqkit.tensor.activation import KernelPreference

_REASON = gpu_skip_reason() or (None if kernels.CUDA_EXTENSION_LOADED else
                                f"the CUDA extension didn't load: {kernels.CUDA_EXTENSION_REASON}")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

TOL = {torch.float16: 2 ** -8, torch.bfloat16: 2 ** -5, torch.float32: 1e-5}
MS = [1, 5, 16, 17, 256]
SHAPES = [pytest.param(200, 37, id="K200-N37"), pytest.param(1024, 1000, id="K1024-N1000")]
CUDA = KernelPreference.CUDA


def _check(config, k, n, m, act_dtype, op):
    torch.manual_seed(k + n + m)
    lin = torch.nn.Linear(k, n, device="cuda", dtype=act_dtype)
    qk.quantize_(lin, config)
    assert any(route.op == op for route in type(lin.weight.qlayout).routes), type(lin.weight.qlayout).__name__
    x = torch.randn(m, k, device="cuda", dtype=act_dtype)
    with torch.no_grad():
        out = lin(x)
        ref = reference_linear(lin.weight, x, lin.bias)
    assert out.dtype == act_dtype and out.shape == (m, n)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[act_dtype] * ref.float().abs().max().item(), (err, ref.float().abs().max().item())


@pytest.mark.parametrize("scale_dtype", [None, "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("act_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_int4_tiled_mma(m, k, n, act_dtype, group, scale_dtype):
    config = qk.Int4WeightOnlyConfig(group_size=group, scale_dtype=scale_dtype, kernel_preference=CUDA)
    _check(config, k, n, m, act_dtype, "torchqkit::linear_int4wo_tiled")


@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "double-quant"])
@pytest.mark.parametrize("act_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("k,n", [pytest.param(192, 37, id="K192-N37"), pytest.param(1024, 1000, id="K1024-N1000")])
@pytest.mark.parametrize("m", MS)
def test_nf4_gemv(m, k, n, act_dtype, double_quant):
    config = qk.NF4WeightOnlyConfig(block_size=64, double_quant=double_quant, kernel_preference=CUDA)
    _check(config, k, n, m, act_dtype, "torchqkit::linear_nf4wo")


@pytest.mark.parametrize("config", [
    pytest.param(dict(), id="e4m3fn-per-row"),
    pytest.param(dict(weight_dtype="float8_e5m2", granularity=qk.PerTensor()), id="e5m2-tensor"),
    pytest.param(dict(granularity=qk.PerBlock((8, 64))), id="e4m3fn-block8x64"),
])
@pytest.mark.parametrize("act_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("k,n", [pytest.param(192, 40, id="K192-N40"), pytest.param(1024, 1000, id="K1024-N1000")])
@pytest.mark.parametrize("m", MS)
def test_fp8_gemv(m, k, n, act_dtype, config):
    _check(qk.Float8WeightOnlyConfig(kernel_preference=CUDA, **config), k, n, m, act_dtype, "torchqkit::linear_fp8wo")


def test_cuda_preference_with_float32_activations_on_int4_names_the_fix():
    """Tensor cores take 16-bit activations: the C++ kernel refuses float32 and says what to do instead."""
    lin = torch.nn.Linear(128, 64, device="cuda")
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=32, kernel_preference=CUDA))
    with pytest.raises(RuntimeError, match="float16 / bfloat16|KernelPreference.TRITON"):
        lin(torch.randn(3, 128, device="cuda"))


def test_compiled_cuda_linear_equals_eager():
    lin = torch.nn.Linear(256, 96, device="cuda", dtype=torch.bfloat16)
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=64, kernel_preference=CUDA))
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(lin, fullgraph=True)(x), lin(x), atol=0, rtol=0)
