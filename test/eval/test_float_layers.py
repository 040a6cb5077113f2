"""torchqkit.eval.float_layers: the measured time per decode step of the float Linears left in a quantized model,
profiled in the loop or, when the profiler can't see their matmul, timed alone (Note [Float layer time])."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.eval.float_layers import ALONE, PROFILED, float_layer_time, float_linears
from torchqkit.eval.speed import DecodeLoop

from .models import tiny_llama

pytest.importorskip("transformers")


def test_a_float_tied_lm_head_is_profiled_in_the_decode_loop():
    model = tiny_llama(96, tied=True)
    qk.quantize_(model, qk.presets.get("int4-wo-g32"))
    assert list(float_linears(model)) == [(96, 32)]                     # lm_head only; its tie counted once
    loop = DecodeLoop(model, torch.arange(8), 4)
    loop.run()
    (t,) = float_layer_time(loop, model)
    assert (t.names, t.shape, t.dtype, t.how) == (("lm_head",), (96, 32), "float32", PROFILED)
    assert t.calls == 1 and t.ms > 0                                  # one matmul per decode step, measured


class EinsumHead(nn.Linear):
    """A Linear whose matmul is an einsum: the profiler sees no mm / addmm / linear on its weight."""

    def forward(self, x):
        return torch.einsum("btk,nk->btn", x, self.weight)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.head = EinsumHead(32, 64, bias=False)

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.emb(ids))))


def test_a_matmul_the_profiler_does_not_see_is_timed_alone():
    model = TinyLM().eval()
    qk.quantize_(model, qk.ModuleConfigs({"body": qk.Int8WeightOnlyConfig()}))
    loop = DecodeLoop(model, torch.arange(4), 3, decode="recompute")
    loop.run()
    (t,) = float_layer_time(loop, model)
    assert (t.names, t.shape, t.how, t.calls) == (("head",), (64, 32), ALONE, 1) and t.ms > 0


def test_nothing_to_measure_when_every_linear_is_quantized():
    model = tiny_llama(96, tied=True)
    qk.quantize_(model, qk.presets.get("int4-wo-g32-out8"))
    assert float_linears(model) == {} and float_layer_time(DecodeLoop(model, torch.arange(8), 2), model) == []
