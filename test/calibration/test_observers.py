"""Static activation ranges: the MSE observer clips a rare massive value that min/max would let set the step."""
from __future__ import annotations

import torch

from torchqkit.algorithms.observers import InputStats, mse_range, static_range
from torchqkit.core.granularity import PerTensor
from torchqkit.core.qdtype import int8
from torchqkit.tensor.activation import ActivationQuantSpec


def _fake_quantize(x, r):
    return ActivationQuantSpec(int8, PerTensor(), static_scale=r / 127.0).fake_quantize(x)


def _output_err(x, r, w):
    return float((torch.nn.functional.linear(_fake_quantize(x, r) - x, w)).square().sum())


def test_mse_range_clips_a_massive_token_and_lowers_the_output_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    x[3, 5] = 60.0  # one rare large activation: min/max's step (0.47) rounds most ordinary values to 0 or +-1
    w = torch.randn(32, 64, generator=g)
    stats = InputStats(64, 4096, max_rows=4096)
    stats.add(x)
    r = static_range(stats, "mse", 99.99, fake_quantize=_fake_quantize, weight=w)
    assert r == mse_range(x, 60.0, _fake_quantize, w)
    # measured: r = 25.2 (the large value clipped to it), 0.43x min/max's output error; it is the error of the
    # Linear's output that decides, so the rare value is clipped only partly (a near-4 range would zero its
    # contribution, which costs more)
    assert 15.0 < r < 35.0
    assert _output_err(x, r, w) < 0.5 * _output_err(x, 60.0, w)
    assert static_range(stats, "minmax", 99.99) == 60.0


def test_mse_range_keeps_the_max_when_nothing_stands_out():
    x = torch.linspace(-1, 1, 640).reshape(10, 64)
    assert mse_range(x, 1.0, _fake_quantize, torch.ones(4, 64)) == 1.0
