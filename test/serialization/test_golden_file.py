"""A file of torchqkit format 1, checked in, must keep loading: every layout, a tie, an int buffer, the
recorded ModuleConfigs. When the format changes, add a file for the new version next to this one and keep
this test; never regenerate format1_all_layouts.safetensors (that would hide a compatibility break).

Written once by ``python -m test.serialization.test_golden_file`` (torchqkit 0.1.0)."""
from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

import torchqkit as qk
from torchqkit.serialization import read_checkpoint_info

from .models import meta_model, model_input, module_configs, quantized_model

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "format1_all_layouts.safetensors"
EXPECTED = DATA / "format1_all_layouts.expected.safetensors"  # dequantized weights + one forward, plain safetensors


def test_format1_file_still_loads():
    model = qk.load_quantized(meta_model(), GOLDEN)
    expected = safetensors.torch.load_file(EXPECTED)
    quantized = {n: m.weight for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), qk.AffineQuantizedTensor)}
    assert len(quantized) == 7
    for name, w in quantized.items():
        assert torch.equal(w.dequantize(), expected[f"{name}.dequantized"]), name  # the bytes mean what they meant
    assert model.head.weight is model.embed.weight
    with torch.no_grad():
        # Kernels may change the rounding of the matmul, never the weights: compare with a tolerance.
        torch.testing.assert_close(model(model_input()), expected["output"], rtol=1e-3, atol=1e-3)
    assert read_checkpoint_info(GOLDEN)["config"] == module_configs()


def _write() -> None:
    DATA.mkdir(exist_ok=True)
    model = quantized_model()
    qk.save_quantized(model, GOLDEN, config=module_configs())
    expected = {f"{n}.dequantized": m.weight.dequantize() for n, m in model.named_modules()
                if isinstance(getattr(m, "weight", None), qk.AffineQuantizedTensor)}
    with torch.no_grad():
        expected["output"] = model(model_input())
    safetensors.torch.save_file(expected, EXPECTED)


if __name__ == "__main__":
    _write()
