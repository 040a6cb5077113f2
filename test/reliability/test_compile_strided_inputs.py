"""torch.compile(fullgraph=True) of a quantized Linear equals eager for non-contiguous inputs (a transposed view, a
strided slice, permuted batch dims): the activation is flattened row-major for every route (layouts/routes.py
flatten_tokens), so no kernel, and no inductor lowering such as _scaled_mm's, sees column-major codes. Compiling is
slow: one small Linear per config, for the activation-quantizing configs and one weight-only tiled kernel."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk

from .configs import config_params

N, K = 32, 128


def _inputs():
    g = torch.Generator().manual_seed(1)
    return {"transposed": torch.randn(K, 5, generator=g).t(),
            "sliced": torch.randn(5, 2 * K, generator=g)[:, ::2],
            "permuted": torch.randn(K, 5, 2, generator=g).permute(2, 1, 0)}


@pytest.mark.parametrize("config", config_params(["fp8-dynamic", "fp8-static", "int8da-int8", "int8da-int4",
                                                  "int4wo"]))
def test_compiled_equals_eager_for_strided_inputs(config):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(K, N).eval()
    qk.quantize_(model, config, strict=True)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    for name, x in _inputs().items():
        assert not x.is_contiguous()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5, msg=name)
