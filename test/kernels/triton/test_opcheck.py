"""torch.library.opcheck for every torchqkit_triton:: op (the interpreter registration: custom op + fake
impl) and for the torchqkit:: GPU ops whose only CPU implementation is their reference."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.kernels.triton import TRITON_OPS


def _weight(config, n, k):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False)
    qk.quantize_(lin, config)
    return lin.weight


def _samples():
    x, bias = torch.randn(3, 64), torch.randn(37)
    i4 = _weight(qk.Int4WeightOnlyConfig(group_size=32, layout=qk.TensorCoreTiledLayout(inner_k_tiles=2)), 37, 64)
    nf = _weight(qk.NF4WeightOnlyConfig(block_size=64, double_quant=True), 37, 64)
    mx = _weight(qk.MXFP4WeightOnlyConfig(), 37, 64)
    i8 = _weight(qk.Int8WeightOnlyConfig(), 37, 64)
    f8 = _weight(qk.Float8WeightOnlyConfig(), 37, 64)
    a, b = torch.randn(3, 64).to(torch.float8_e4m3fn), torch.randn(37, 64).to(torch.float8_e5m2)
    return {
        "linear_int4wo_tiled": (x, i4.qdata, i4.scale_and_zero, 32, 37, bias),
        "linear_nf4wo": (x, nf.qdata, None, nf.scale_codes, nf.scale_block_scale, nf.scale_offset, 64, bias),
        "linear_mxwo": (x, mx.qdata, mx.scale, bias),
        "linear_fp8wo": (x, f8.qdata, f8.scale, bias),
        "linear_int8wo_plain": (x, i8.qdata, i8.scale, bias),
        "scaled_mm_fp8_rowwise": (a, b, torch.rand(3, 1), torch.rand(37, 1), bias, torch.float32),
    }


# opcheck's test_schema compares inputs before / after with arithmetic that has no float8 CPU kernel
# ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn): float8 inputs skip that one check.
_NO_SCHEMA_CHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, name):
    utils = _NO_SCHEMA_CHECK if name in ("scaled_mm_fp8_rowwise", "linear_fp8wo") else torch.library._OPCHECK_DEFAULT_UTILS
    torch.library.opcheck(op, _samples()[name], test_utils=utils)


@pytest.mark.parametrize("name", sorted(op.split("::")[1] for op in TRITON_OPS))
def test_triton_op(name):
    _opcheck(getattr(torch.ops.torchqkit_triton, name).default, name)


@pytest.mark.parametrize("name", ["linear_mxwo", "scaled_mm_fp8_rowwise"])
def test_reference_only_op(name):
    _opcheck(getattr(torch.ops.torchqkit, name).default, name)


def test_the_interpreter_registers_every_triton_kernel():
    assert sorted(TRITON_OPS) == ["torchqkit::linear_fp8wo", "torchqkit::linear_int4wo_tiled",
                                  "torchqkit::linear_int8wo_plain",
                                  "torchqkit::linear_mxwo", "torchqkit::linear_nf4wo",
                                  "torchqkit::scaled_mm_fp8_rowwise"]
