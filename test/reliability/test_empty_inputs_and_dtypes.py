"""Every config takes an input with no tokens ((0, K), (2, 0, K)) and returns an empty (..., N) output, eagerly and on
the AUTO kernels and the reference; every config returns the input's float dtype (float32 / float16 / bfloat16,
whatever the layer's dtype); a calibration batch with 0 tokens is skipped with a warning naming the Linear."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import torchqkit as qk
from test.common import TinyTransformer

from .configs import CONFIGS, config_params

N, K = 32, 128
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _quantized(config, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(K, N, dtype=dtype)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qk.quantize_(model, config, strict=True)
    return model


@pytest.mark.parametrize("preference", ["auto", "reference"])
@pytest.mark.parametrize("config", config_params())
def test_an_input_with_no_tokens_gives_an_empty_output(config, preference):
    model = _quantized(dataclasses.replace(config, kernel_preference=preference))
    for shape in [(0, K), (2, 0, K)]:
        with torch.no_grad():
            out = model(torch.randn(shape))
        assert out.shape == (*shape[:-1], N) and out.dtype == torch.float32


@pytest.mark.parametrize("weight_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", config_params())
def test_the_output_has_the_input_dtype(config, weight_dtype):
    model = _quantized(config, weight_dtype)
    for dtype in DTYPES:
        x = torch.randn(3, K, generator=torch.Generator().manual_seed(1)).to(dtype)
        with torch.no_grad():
            out = model(x)
        assert out.dtype == dtype and out.shape == (3, N) and torch.isfinite(out).all(), (weight_dtype, dtype)


@pytest.mark.parametrize("config", [qk.Int8StaticActivationInt8WeightConfig(),
                                    qk.GPTQConfig(qk.Int4WeightOnlyConfig(group_size=32))],
                         ids=["static-int8", "gptq"])
def test_a_calibration_batch_with_no_tokens_is_skipped_with_a_warning(config):
    torch.manual_seed(0)
    float_model = TinyTransformer(n_layers=1).eval()
    batches = [torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(2))]
    models = [TinyTransformer(n_layers=1).eval() for _ in range(2)]
    for m in models:
        m.load_state_dict(float_model.state_dict())
    qk.quantize_(models[0], config, calibration_data=batches)
    with pytest.warns(UserWarning, match=r"a batch reached layers\.0\.\S+ with 0 tokens .* skipped"):
        qk.quantize_(models[1], config, calibration_data=batches + [torch.randn(1, 0, 128)])
    x = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(models[1](x), models[0](x), rtol=0, atol=0)  # the empty batch changed nothing
