"""Quantized weights are frozen and say so: asking one to require grad raises (it would train nothing), while
QLoRA-style training through it, nn.Parameter(w, requires_grad=False) and load_state_dict(assign=True) into a
fresh model keep working; copying a quantized state dict into a float model says what to do instead of failing
with an AttributeError."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchqkit as qk


def _nf4():
    return qk.quantize_weight(torch.randn(32, 64), qk.qdtypes.nf4, qk.PerGroup(64), qk.NF4Layout())


def test_asking_for_grad_raises():
    w = _nf4()
    for ask in (lambda: w.requires_grad_(), lambda: w.requires_grad_(True), lambda: setattr(w, "requires_grad", True),
                lambda: nn.Parameter(w), lambda: nn.Parameter(w, requires_grad=True)):
        with pytest.raises(RuntimeError, match="quantized weights are frozen"):
            ask()
    assert not w.requires_grad
    model = nn.Sequential(nn.Linear(64, 32))
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    with pytest.raises(RuntimeError, match="LoRA"):
        model.requires_grad_(True)


def test_frozen_uses_keep_working():
    w = _nf4()
    assert w.requires_grad_(False) is w and not w.requires_grad
    w.requires_grad = False
    p = nn.Parameter(w, requires_grad=False)
    assert isinstance(p, qk.AffineQuantizedTensor) and not p.requires_grad
    x = torch.randn(4, 64, requires_grad=True)  # QLoRA: the gradient flows to the input (and adapters)
    F.linear(x, p).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 32) @ w.dequantize())


def test_load_state_dict_assign_into_a_fresh_model_keeps_the_weights_frozen():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    qk.quantize_(model, qk.NF4WeightOnlyConfig(block_size=32))
    with torch.device("meta"):
        fresh = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    assert fresh[0].weight.requires_grad
    fresh.load_state_dict(model.state_dict(), assign=True)
    assert isinstance(fresh[0].weight, qk.AffineQuantizedTensor) and not fresh[0].weight.requires_grad
    assert fresh[0].bias.requires_grad
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_quantized_state_dict_into_a_float_model_explains_assign():
    model = nn.Sequential(nn.Linear(64, 32))
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    float_model = nn.Sequential(nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match=r"assign=True") as err:
        float_model.load_state_dict(model.state_dict())
    assert "attributes" not in str(err.value)
    with pytest.raises(RuntimeError, match="never does implicitly"):
        torch.empty(32, 64).copy_(model[0].weight)
