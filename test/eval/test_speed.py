"""torchqkit.eval.decode_tokens_per_second: generates exactly the tokens asked for (through transformers'
generate, or the recompute loop for plain modules) and times them."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchqkit.eval import decode_tokens_per_second
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
    stamps = speed._generate_run(model, PROMPT.unsqueeze(0), 6)
    assert len(stamps) == 6 and stamps == sorted(stamps)
    rate = decode_tokens_per_second(model, PROMPT, new_tokens=6, repeats=2)
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
    rate = decode_tokens_per_second(model, PROMPT[:3] % 20, new_tokens=4, repeats=1)
    assert math.isfinite(rate) and rate > 0
    # warm-up + 1 timed run, each feeding the whole sequence again: 3, 4, 5, 6 tokens.
    assert calls == [3, 4, 5, 6] * 2


@pytest.mark.parametrize("kwargs, message", [
    ({"new_tokens": 1}, "new_tokens must be an int >= 2"),
    ({"repeats": 0}, "repeats must be a positive int"),
])
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        decode_tokens_per_second(nn.Embedding(20, 20), PROMPT % 20, **kwargs)
