"""Greedy decode speed of a causal LM, in new tokens per second (see Note [Decode timing])."""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from .perplexity import check_token_ids, logits_of, model_vocab_size

__all__ = ["decode_tokens_per_second"]

# Note [Decode timing]
# ~~~~~~~~~~~~~~~~~~~~
# A run greedily generates `new_tokens` tokens after the prompt and records the wall-clock time at which
# each new token exists. The first one comes out of the prefill (the whole prompt in one pass), which
# is a different workload (matrix-matrix, not matrix-vector), so a run's rate is
#     (new_tokens - 1) / (time of the last token - time of the first token),
# i.e. decode steps only. One untimed run first absorbs one-time costs (allocations, lazy imports,
# kernel selection); the result is the rate of the run with the median duration among `repeats`.
# Models with `generate` (transformers) run it with do_sample=False and min = max = new_tokens, so
# generation never stops early at an end-of-sequence token; the time stamps come from a stopping
# criterion that never stops (it is called once per new token). Other modules are decoded by a loop
# that reruns the whole sequence each step (they expose no KV cache to reuse).


def decode_tokens_per_second(model: nn.Module, input_ids: torch.Tensor, new_tokens: int = 32,
                             repeats: int = 3) -> float:
    """Median greedy decode rate (tokens/s, prefill excluded) of `model` after the prompt `input_ids`.

    input_ids: the prompt, 1-d or (1, T) integer ids (at least 2 tokens). new_tokens >= 2: tokens generated
    per run. repeats >= 1: timed runs after one untimed warm-up run. See Note [Decode timing].
    """
    ids = check_token_ids(input_ids, model_vocab_size(model)).unsqueeze(0)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an int >= 2 (the first token comes from the prefill), got {new_tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    for tensor in model.parameters():
        ids = ids.to(tensor.device)
        break
    run = _generate_run if callable(getattr(model, "generate", None)) else _recompute_run
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            run(model, ids, new_tokens)
            durations = []
            for _ in range(repeats):
                stamps = run(model, ids, new_tokens)
                if len(stamps) != new_tokens:
                    raise RuntimeError(f"the model generated {len(stamps)} tokens instead of {new_tokens}")
                durations.append(stamps[-1] - stamps[0])
    finally:
        model.train(was_training)
    return (new_tokens - 1) / statistics.median(durations)


def _generate_run(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> list[float]:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stamps(StoppingCriteria):
        """Records when each new token exists; never asks generation to stop."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    stamps = _Stamps()
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "eos_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=new_tokens,
                   max_new_tokens=new_tokens, stopping_criteria=StoppingCriteriaList([stamps]),
                   pad_token_id=pad)
    return stamps.times


def _recompute_run(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> list[float]:
    times = []
    for _ in range(new_tokens):
        next_id = logits_of(model, ids)[:, -1].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
        times.append(time.perf_counter())
    return times
