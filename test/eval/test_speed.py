"""torchqkit.eval.decode_tokens_per_second and decode_breakdown: generate exactly the tokens asked for (through
the lean loop, transformers' generate, or the recompute loop for plain modules) and time them."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.eval import DecodeLoop, decode_breakdown, decode_tokens_per_second
from torchqkit.eval import speed

from .models import tiny_llama

pytest.importorskip("transformers")

PROMPT = torch.tensor([3, 14, 15, 92, 65, 35])


def test_generate_path_does_not_stop_at_eos():
    model = tiny_llama(96)
    # Make the first greedy token the end-of-sequence token: without min_new_tokens, generate would stop there.
    with torch.no_grad():
        first = model(PROMPT.unsqueeze(0)).logits[0, -1].argmax().item()
    model.generation_config.eos_token_id = first
    stamps = []
    speed._generate_run(model, PROMPT.unsqueeze(0), 6, lambda i: stamps.append(i))
    assert stamps == [0, 1, 2, 3, 4, 5]
    rate = decode_tokens_per_second(model, PROMPT, new_tokens=6, repeats=2, decode="generate")
    assert math.isfinite(rate) and rate > 0


def test_recompute_path_for_plain_modules():
    calls = []

    class Bigram(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 20)

        def forward(self, x):
            calls.append(x.shape[1])
            return self.embed(x)

    model = Bigram()
    rate = decode_tokens_per_second(model, PROMPT[:3] % 20, new_tokens=4, repeats=1, decode="recompute")
    assert math.isfinite(rate) and rate > 0
    # warm-up + 1 timed run, each feeding the whole sequence again: 3, 4, 5, 6 tokens.
    assert calls == [3, 4, 5, 6] * 2


def test_lean_loop_times_every_token():
    model = tiny_llama(96)
    loop = DecodeLoop(model, PROMPT, 5)
    seen = []
    times = loop.run(seen.append)
    assert seen == [0, 1, 2, 3, 4] and len(times) == 5 and times == sorted(times)
    assert loop.compile_seconds is None
    generated = DecodeLoop(model, PROMPT, 5, decode="generate")
    generated.run()
    assert len(loop.tokens) == 5 and loop.tokens == generated.tokens
    assert math.isfinite(decode_tokens_per_second(model, PROMPT, new_tokens=5, repeats=1))


def test_breakdown_counts_the_quantized_linears_of_a_step():
    model = tiny_llama(96)
    config = qk.Int4WeightOnlyConfig(group_size=32)
    qk.quantize_(model, qk.ModuleConfigs({"lm_head": config, "_default": config}))
    loop = DecodeLoop(model, PROMPT, 5)
    loop.run()
    parts = decode_breakdown(loop, repeats=1)
    # Per decode step: 2 layers x 7 Linears + the tied lm_head, all int4 kernels; no float matmul left; one
    # attention call per layer.
    assert parts.calls_per_token == {"quantized linears": 15, "float matmuls": 0, "attention": 2}
    assert parts.kernels["quantized linears"] > 0 and parts.kernels["float matmuls"] == 0
    assert parts.total > 0 and parts.rest == pytest.approx(parts.total - sum(parts.kernels.values()))
    assert str(parts).startswith(f"{parts.total:.2f} ms/token = quantized linears")


@pytest.mark.parametrize("kwargs, message", [
    ({"new_tokens": 1}, "new_tokens must be an int >= 2"),
    ({"repeats": 0}, "repeats must be a positive int"),
    ({"decode": "beam"}, "decode must be one of lean, generate, recompute"),
    ({"decode": "generate", "compile": True}, "compile=True compiles the lean loop's step"),
])
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        decode_tokens_per_second(nn.Embedding(20, 20), PROMPT % 20, **kwargs)
