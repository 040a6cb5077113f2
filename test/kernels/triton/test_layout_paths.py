"""A quantized weight whose KernelPreference is TRITON runs its layout's linear on the Triton kernel (here
under TRITON_INTERPRET=1 on CPU, natively on a GPU: the ``device`` fixture), eagerly and under
torch.compile(fullgraph=True), and agrees with the reference.
float16 activations: see test_triton_kernels.py for why never bfloat16 under the interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.tensor.activation import KernelPreference
from test.common import OpLog




def _sparse_int8(kernel_preference):
    """2:4 N:M sparse int8: the preference goes on the base config, whose codes NMSparseLayout stores."""
    return qk.SparsityConfig(pattern=(2, 4), base=qk.Int8WeightOnlyConfig(kernel_preference=kernel_preference))


def _model(pref, device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 37).half().to(device)
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=32, kernel_preference=pref))
    return lin


def test_int4_linear_with_triton_preference_runs_the_triton_kernel(device):
    lin = _model(KernelPreference.TRITON, device)
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    with OpLog(qualified=True) as log:
        out = lin(x)
    assert "torchqkit_triton.linear_int4wo_tiled" in log.ops and "torchqkit.linear_int4wo_tiled" not in log.ops
    ref = F.linear(x.float(), lin.weight.dequantize().float(), lin.bias.float())
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)  # fp16 weights in tl.dot, fp16 output


def test_triton_preference_compiles_fullgraph(device):
    lin = _model(KernelPreference.TRITON, device)
    x = torch.randn(5, 64, dtype=torch.float16, device=device)
    with torch.no_grad():
        eager = lin(x)
        compiled = torch.compile(lin, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


@pytest.mark.parametrize("config, op", [
    (qk.Int8WeightOnlyConfig, "linear_int8wo_plain"),
    (qk.NF4WeightOnlyConfig, "linear_nf4wo"),
    (qk.Float8WeightOnlyConfig, "linear_fp8wo"),
    (qk.MXFP4WeightOnlyConfig, "linear_mxwo"),
    (qk.NVFP4WeightOnlyConfig, "linear_nvfp4wo"),
    (qk.FP6WeightOnlyConfig, "linear_fp6wo"),
    (lambda **kw: qk.IntxWeightOnlyConfig(bits=3, **kw), "linear_intxwo"),
    (lambda **kw: qk.IntxWeightOnlyConfig(bits=2, mapping="symmetric_no_clipping_err",
                                          layout=qk.PackedIntxLayout(ternary=True), **kw), "linear_ternarywo"),
    (qk.Int4DynamicActivationInt4WeightConfig, "linear_intxwo"),
    (_sparse_int8, "linear_nm_sparse_wo"),
    (qk.Float8DynamicActivationFloat8WeightConfig, "scaled_mm_fp8_rowwise"),
])
def test_every_layout_with_a_triton_kernel_runs_it_when_asked(config, op, device):
    """Each layout's route names its op, so TRITON reaches that op's Triton kernel (never a silent reference)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).half().to(device)
    kwargs = {"granularity": qk.PerRow()} if config is qk.Float8DynamicActivationFloat8WeightConfig else {}
    qk.quantize_(lin, config(kernel_preference=KernelPreference.TRITON, **kwargs))
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    with OpLog(qualified=True) as log, torch.no_grad():
        out = lin(x)
    assert f"torchqkit_triton.{op}" in log.ops, log.ops
    ref = qk.layouts.routes.reference_linear(lin.weight, x, lin.bias).float()
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
