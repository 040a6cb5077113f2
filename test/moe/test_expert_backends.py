"""Each routed expert of a grouped matmul runs its layout's 2-d kernel of the weight's KernelPreference: the C++ CPU
kernel (AUTO on CPU), the Triton kernel (TRITON: under TRITON_INTERPRET=1 on CPU, natively on a GPU), or the
reference. The grouped output equals, bit for bit, F.linear of each group's rows with that expert's 2-d view (the
same kernel on the same inputs), and matches the dequantized float product within the kernel's own tolerance
(fp16 weights in tl.dot and an fp16 output: 1e-2, as test/kernels/triton/test_layout_paths.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.api.expert_weights import quantize_experts
from torchqkit.tensor.activation import KernelPreference
from test.common import OpLog

E, N, K = 3, 40, 64
OFFS = (2, 2, 5)  # expert 1 gets no tokens

CASES = [
    (qk.Int4WeightOnlyConfig, {"group_size": 32}, "linear_int4wo_tiled"),
    (qk.Int8WeightOnlyConfig, {}, "linear_int8wo_plain"),
    (qk.NF4WeightOnlyConfig, {}, "linear_nf4wo"),
]




@pytest.mark.parametrize("pref", [KernelPreference.AUTO, KernelPreference.TRITON, KernelPreference.REFERENCE],
                         ids=lambda p: p.value)
@pytest.mark.parametrize("config, kwargs, op", CASES, ids=[c[2] for c in CASES])
def test_grouped_experts_run_the_preferred_backend(config, kwargs, op, pref, device):
    torch.manual_seed(0)
    weight = torch.randn(E, N, K, dtype=torch.float16, device=device)
    stack = quantize_experts(config(kernel_preference=pref, **kwargs), weight, "experts")
    x = torch.randn(OFFS[-1], K, dtype=torch.float16, device=device)
    out = torch._grouped_mm(x, stack.transpose(-2, -1), offs=torch.tensor(OFFS, device=device))
    w = stack.dequantize().float()
    starts = (0, *OFFS[:-1])
    for e, (start, end) in enumerate(zip(starts, OFFS)):
        if end == start:
            continue
        with OpLog(qualified=True) as log:
            one = F.linear(x[start:end], stack[e])
        torch.testing.assert_close(out[start:end], one, atol=0, rtol=0)
        torch.testing.assert_close(out[start:end].float(), x[start:end].float() @ w[e].T, atol=1e-2, rtol=1e-2)
        if pref is KernelPreference.TRITON:
            assert f"torchqkit_triton.{op}" in log.ops
        elif pref is KernelPreference.AUTO and device == "cpu":
            assert f"torchqkit.{op}" in log.ops
        else:
            assert not any(o.startswith("torchqkit") for o in log.ops)
