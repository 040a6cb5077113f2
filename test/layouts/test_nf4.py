"""NF4Layout: pinned bytes, double quantization, byte arithmetic, slicing, QLoRA-style training."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.core import qdtypes as Q

from ..common import sqnr

LEVELS = Q.nf4.levels


def _nf4(w, block_size=64, double_quant=False):
    return qk.quantize_weight(w, Q.nf4, qk.PerGroup(block_size), qk.NF4Layout(block_size, double_quant),
                              scale_dtype=torch.float32)


def test_packed_bytes_pinned():
    w = torch.zeros(1, 64)
    w[0, :4] = torch.tensor([-2.0, 2.0, 0.0, LEVELS[13] * 2])  # absmax 2: codes 0, 15, 7, 13; the rest 0 -> 7
    aqt = _nf4(w)
    # byte j = code[2j] << 4 | code[2j + 1]
    assert aqt.qdata.dtype == torch.uint8 and aqt.qdata.shape == (1, 32)
    assert aqt.qdata[0].tolist() == [0x0F, 0x7D] + [0x77] * 30
    assert aqt.scale.tolist() == [[2.0]] and aqt.scale.dtype == torch.float32
    assert aqt.dequantize()[0, :4].tolist() == [-2.0, 2.0, 0.0, LEVELS[13] * 2]


def test_double_quant_pinned():
    # Four blocks of 64 with absmax 1, 2, 3, 6: offset = mean = 3; absmax - offset = -2, -1, 0, 3 in one
    # group of 256 (padded); int8 symmetric scale 3 / 127.5; codes round(-85.0), round(-42.5) = -42
    # (half to even), 0, 127.5 -> 128 clamped to 127.
    w = torch.zeros(2, 128)
    w[0, 0], w[0, 64], w[1, 0], w[1, 64] = 1.0, -2.0, 3.0, 6.0
    aqt = _nf4(w, double_quant=True)
    assert aqt.scale is None
    assert aqt.scale_codes.dtype == torch.int8 and aqt.scale_codes.tolist() == [[-85, -42], [0, 127]]
    assert aqt.scale_block_scale.tolist() == [torch.tensor(3 / 127.5, dtype=torch.float32).item()]
    assert aqt.scale_offset.tolist() == [3.0]
    absmax = qk.NF4Layout(double_quant=True).unpack(aqt).scale
    s = torch.tensor(3 / 127.5, dtype=torch.float32)
    assert torch.equal(absmax, torch.tensor([[-85.0, -42.0], [0.0, 127.0]]) * s + 3.0)  # 1.0, 2.012, 3.0, 5.988


def test_stored_bytes_match_format_arithmetic():
    n, k = 96, 1024
    w = torch.randn(n, k)
    blocks = n * k // 64  # 1536 blocks -> 6 second-level groups
    plain = _nf4(w)
    assert plain.packed_nbytes() == n * k // 2 + 4 * blocks  # 4 bits + one fp32 absmax per 64
    dq = _nf4(w, double_quant=True)
    # 4 bits + 8 bits per 64 + one fp32 per 256 blocks + one fp32 offset
    assert dq.packed_nbytes() == n * k // 2 + blocks + 4 * (blocks // 256) + 4
    assert {t.dtype for t in dq.inner_tensors().values() if t is not None} == {torch.uint8, torch.int8,
                                                                              torch.float32}


def test_double_quant_costs_little_quality():
    w = torch.randn(128, 512, generator=torch.Generator().manual_seed(0))
    single, double = sqnr(w, _nf4(w).dequantize()), sqnr(w, _nf4(w, double_quant=True).dequantize())
    assert single > 19.5 and single - double < 0.1  # measured 20.6 / 20.6 dB


def test_double_quant_partial_last_group():
    w = torch.randn(5, 192)  # 15 blocks: one partial group of 256
    aqt = _nf4(w, double_quant=True)
    assert aqt.scale_block_scale.shape == (1,)
    torch.testing.assert_close(aqt.dequantize(), w, rtol=0, atol=0.2 * w.abs().max().item())


def test_double_quant_slices():
    aqt = _nf4(torch.randn(64, 1024), double_quant=True)  # 16 blocks a row: 16 rows per group of 256
    aligned = aqt[16:48]
    assert aligned.qlayout.double_quant and aligned.scale_block_scale.shape == (2,)
    assert aligned.scale_codes.untyped_storage().data_ptr() == aqt.scale_codes.untyped_storage().data_ptr()
    assert torch.equal(aligned.dequantize(), aqt.dequantize()[16:48])
    for part, ref in ((aqt[8:24], aqt.dequantize()[8:24]), (aqt[:, 128:256], aqt.dequantize()[:, 128:256])):
        # a cut inside a group keeps the dequantized absmax in float32: exact, no longer double-quantized
        assert not part.qlayout.double_quant and part.scale.dtype == torch.float32
        assert part.qdata.untyped_storage().data_ptr() == aqt.qdata.untyped_storage().data_ptr()
        assert torch.equal(part.dequantize(), ref)


class LoRALinear(nn.Module):
    """A frozen (quantized) base Linear plus a trainable low-rank update: y = base(x) + (x A^T) B^T * scale."""

    def __init__(self, base: nn.Linear, rank=4, alpha=8.0):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scaling = alpha / rank

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scaling


@pytest.mark.parametrize("double_quant", [False, True])
def test_qlora_training_through_nf4_linear(double_quant):
    torch.manual_seed(0)
    base = nn.Linear(128, 64)
    qk.quantize_(base, qk.NF4WeightOnlyConfig(double_quant=double_quant))
    assert isinstance(base.weight, qk.AffineQuantizedTensor) and not base.weight.requires_grad
    base.bias.requires_grad_(False)
    model = LoRALinear(base)
    target = nn.Linear(128, 64)  # a different function the adapter has to move towards
    x = torch.randn(32, 128, requires_grad=True)
    y = target(x).detach()
    opt = torch.optim.Adam([model.lora_a, model.lora_b], lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert x.grad is not None and x.grad.abs().sum() > 0          # gradient reached the input
    assert model.lora_a.grad.abs().sum() > 0 and model.lora_b.grad.abs().sum() > 0
    assert base.weight.grad is None                               # the frozen NF4 weight got none


def test_config_and_supports_reasons():
    cfg = qk.NF4WeightOnlyConfig(block_size=32, double_quant=True)
    assert qk.config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="positive even int"):
        qk.NF4WeightOnlyConfig(block_size=33)
    layout = qk.NF4Layout()
    assert "not int4" in layout.supports(qk.layouts.WeightFormat.of(Q.int4, (1, 64), (8, 128), "none"))
    assert "needs blocks of (1, 64)" in layout.supports(qk.layouts.WeightFormat.of(Q.nf4, (1, 32), (8, 128), "none"))
    model = nn.Sequential(nn.Linear(96, 16), nn.Linear(128, 16))  # 96: one block and a half, padded inside
    report = qk.quantize_(model, qk.NF4WeightOnlyConfig(), strict=True)
    assert len(report.quantized) == 2 and model[0].weight.qdata.shape == (16, 64)
