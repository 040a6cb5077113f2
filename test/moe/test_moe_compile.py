"""torch.compile(fullgraph=True) of a quantized MoE block: one graph, the same output as eager, and the compiled code
calls the grouped quantized linear (no float expert weight is materialized). transformers' "eager" experts loop
over ``nonzero()`` of the routing mask, which no fullgraph compile takes even for the float model; "grouped_mm"
(whose non-bfloat16 compiled path is transformers' own fallback op) and "batched_mm" compile. Tolerance: the same
kernels run in both, 1e-5 absolute. "batched_mm" is traced with the aot_eager backend (the same subclass tracing
and fullgraph check, without inductor's C++ build) to keep the file under ~30 s on a shared 2-core host."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import torchqkit as qk

from ..common import op_calls
from .models import tiny_moe


@pytest.mark.parametrize("impl,backend", [("grouped_mm", "inductor"), ("batched_mm", "aot_eager")])
def test_compiled_moe_block_equals_eager(impl, backend):
    """inductor with its C++ wrapper, as the compiled decode step runs (the grouped op's str argument goes into a C++
    literal there)."""
    model = tiny_moe("qwen3_moe")
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
    model.set_experts_implementation(impl)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = block(x)
        options = {"cpp_wrapper": True} if backend == "inductor" else None
        compiled = torch.compile(block, fullgraph=True, backend=backend, options=options)
        out, code = run_and_get_code(compiled, x) if backend == "inductor" else (compiled(x), None)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)
    if code is not None:
        # gate_up_proj and down_proj: the grouped op, which runs the int4 grouped C++ op inside
        assert op_calls("\n".join(code), "grouped_linear_quantized") == 2
