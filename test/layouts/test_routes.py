"""Each layout's routes drive its linear and its status() rows; a named backend runs exactly that backend or
raises (layouts/routes.py, Note [Kernel preference])."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.kernels import KernelPreference
from torchqkit.layouts import all_layouts
from torchqkit.layouts.routes import reference_linear, route_for


def _linear(config, k=64, n=24, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    qk.quantize_(lin, config)
    return lin


def test_status_has_one_row_per_route_plus_the_reference_row():
    rows = [r for r in qk.kernels.status() if r["layout"] not in ("(op)", "(backend)")]
    for layout in all_layouts():
        mine = [r for r in rows if r["layout"] == layout.name]
        assert [r["linear"] for r in mine[:-1]] == [route.case for route in layout.routes]
        assert mine[-1]["path"] == "reference"
        for route, row in zip(layout.routes, mine):
            assert row["path"].startswith(route.aten_name if route.aten else route.op)


@pytest.mark.parametrize("config, op", [
    (qk.Int8WeightOnlyConfig(), "torchqkit::linear_int8wo_plain"),
    (qk.Int8DynamicActivationInt8WeightConfig(), "torchqkit::linear_int8da_int8_plain"),
    (qk.Int4WeightOnlyConfig(group_size=32), "torchqkit::linear_int4wo_tiled"),
    (qk.NF4WeightOnlyConfig(block_size=32), "torchqkit::linear_nf4wo"),
])
def test_auto_takes_the_declared_route_and_matches_the_reference(config, op):
    lin = _linear(config)
    x = torch.randn(3, 64)
    assert route_for(lin.weight, x).op == op
    with torch.no_grad():
        torch.testing.assert_close(lin(x), reference_linear(lin.weight, x, lin.bias), atol=2e-2, rtol=2e-3)


def test_float64_activations_take_the_reference_under_auto():
    lin = _linear(qk.NF4WeightOnlyConfig(block_size=32)).double()
    x = torch.randn(2, 64, dtype=torch.float64)
    assert route_for(lin.weight, x) is None
    with torch.no_grad():
        assert lin(x).dtype == torch.float64


def test_cuda_preference_on_cpu_tensors_raises_naming_layout_case_op_and_reason():
    lin = _linear(qk.NF4WeightOnlyConfig(block_size=32, kernel_preference=KernelPreference.CUDA))
    with pytest.raises(RuntimeError) as e, torch.no_grad():
        lin(torch.randn(2, 64))
    msg = str(e.value)
    for part in ("NF4Layout", "nf4 weight-only", "torchqkit::linear_nf4wo", "KernelPreference.CUDA", "cpu"):
        assert part in msg, (part, msg)


def test_named_backend_for_a_case_no_op_serves_raises_instead_of_the_reference():
    # int8 dynamic activations x int3 weights: no kernel reads them (the int8 x int kernels take int8 and packed
    # int4), so TRITON can't be honoured
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 24)
    qk.quantize_(lin, qk.Int8DynamicActivationIntxWeightConfig(weight_bits=3, weight_granularity=qk.PerGroup(32),
                                                               kernel_preference=KernelPreference.TRITON))
    with pytest.raises(RuntimeError, match="no torchqkit op serves this case; it runs on the reference"), torch.no_grad():
        lin(torch.randn(2, 64))


def test_named_backend_for_an_aten_route_raises():
    lin = _linear(qk.Int8StaticActivationInt8WeightConfig(act_scale=0.05, kernel_preference=KernelPreference.TRITON))
    with pytest.raises(RuntimeError, match=r"aten._int_mm only"), torch.no_grad():
        lin(torch.randn(2, 64))


def test_reference_preference_is_the_reference_bit_for_bit():
    lin = _linear(qk.Int4WeightOnlyConfig(group_size=32, kernel_preference=KernelPreference.REFERENCE))
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight.dequantize(), lin.bias))
