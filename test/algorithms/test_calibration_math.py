"""GPTQ, AWQ, SmoothQuant and observers as functions of tensors: each beats round-to-nearest on its own
objective, on inputs with correlated / outlier channels (where the methods matter)."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.algorithms.awq import awq_clip, awq_scales
from torchqkit.algorithms.gptq import HessianAccumulator, gptq_codes
from torchqkit.algorithms.observers import InputStats, static_range
from torchqkit.algorithms.smoothquant import smoothing_scales
from torchqkit.api.calibration_grid import ConfigGrid


def _inputs(t=512, k=96, seed=0):
    """Token rows with correlated channels and a few outlier channels, like a transformer's hidden states."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(t, k, generator=g) @ mix
    x[:, :4] *= 8.0
    return x


def _out_err(x, w, wq):
    return float((x @ (w - wq).t()).square().mean())


def test_hessian_is_two_over_n_xtx_whatever_the_batching():
    x = _inputs(t=300, k=16)
    acc = HessianAccumulator(16)
    for chunk in x.split(70):
        acc.add(chunk)
    torch.testing.assert_close(acc.h, 2 * x.t() @ x / 300, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_output_error_of_int4_on_the_config_grid(act_order):
    torch.manual_seed(0)
    x, w = _inputs(), torch.randn(64, 96)
    config = qk.Int4WeightOnlyConfig(group_size=32, layout=qk.PlainLayout())
    grid = ConfigGrid(config, w, "w")
    acc = HessianAccumulator(96)
    acc.add(x)
    codes, scale, zero = gptq_codes(w, acc.h, grid, act_order=act_order)
    aqt = grid.pack(codes, scale, zero)
    rtn = grid.fake_quantize(w)
    gptq, rtn_err = aqt.dequantize(), _out_err(x, w, rtn)
    # measured: GPTQ 0.43x (act-order 0.41x) the output error of round-to-nearest here
    assert _out_err(x, w, gptq) < 0.6 * rtn_err
    # ordinary layout data: codes on the config's uint4 grid, dequantize() is the oracle's
    assert aqt.qlayout == qk.PlainLayout() and int(aqt.qdata.max()) <= 15
    torch.testing.assert_close(gptq, qk.dequantize_affine(codes.to(torch.uint8), qk.qdtypes.uint4, (1, 32), scale, zero,
                                                          zero_point_domain=aqt.zero_point_domain))


def test_gptq_static_groups_keep_round_to_nearest_qparams():
    x, w = _inputs(), torch.randn(32, 96)
    grid = ConfigGrid(qk.Int4WeightOnlyConfig(group_size=32, layout=qk.PlainLayout()), w, "w")
    acc = HessianAccumulator(96)
    acc.add(x)
    _, scale, zero = gptq_codes(w, acc.h, grid, static_groups=True)
    rtn_scale, rtn_zero = grid.qparams(w)
    assert torch.equal(scale, rtn_scale) and torch.equal(zero, rtn_zero)


def test_gptq_on_an_input_channel_that_is_always_zero():
    x, w = _inputs(k=64), torch.randn(16, 64)
    x[:, 5] = 0
    acc = HessianAccumulator(64)
    acc.add(x)
    grid = ConfigGrid(qk.Int8WeightOnlyConfig(), w, "w")
    codes, scale, zero = gptq_codes(w, acc.h, grid)
    assert torch.isfinite(grid.pack(codes, scale, zero).dequantize()).all()


def test_awq_scales_never_lose_to_round_to_nearest_and_help_with_outliers():
    x, w = _inputs(), torch.randn(48, 96)
    grid = ConfigGrid(qk.Int4WeightOnlyConfig(group_size=32, layout=qk.PlainLayout()), w, "w")
    s, ratio = awq_scales(x, x.abs().mean(0), [w], [grid.fake_quantize], n_grid=20)
    scaled = grid.fake_quantize(w * s) / s
    assert ratio > 0 and _out_err(x, w, scaled) < 0.8 * _out_err(x, w, grid.fake_quantize(w))


def test_awq_clip_lowers_the_error_of_each_group():
    x, w = _inputs(), torch.randn(48, 96)
    w[0, 3] = 12.0  # one outlier weight stretches its group's range
    grid = ConfigGrid(qk.Int4WeightOnlyConfig(group_size=32, layout=qk.PlainLayout()), w, "w")
    clipped = awq_clip(x, w, grid.fake_quantize, 32)
    assert clipped.abs().max() < 12.0
    assert _out_err(x, w, grid.fake_quantize(clipped)) < _out_err(x, w, grid.fake_quantize(w))


def test_smoothing_scales_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([[1.0, 4.0, 2.0, 0.0]])
    s = smoothing_scales(act, [w], alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))  # zero activation / weight channels: 1


def test_static_range_minmax_is_exact_and_percentile_below_it():
    stats = InputStats(8, total_rows=200, max_rows=100)
    x = torch.randn(200, 8)
    x[17, 3] = 50.0
    for part in x.split(64):
        stats.add(part)
    assert static_range(stats, "minmax", 99.9) == 50.0
    assert static_range(stats, "percentile", 99.0) < 5.0
    torch.testing.assert_close(stats.mean_abs, x.abs().mean(0))
    smooth = torch.full((8,), 2.0)
    assert static_range(stats, "minmax", 99.9, smooth) == 25.0
