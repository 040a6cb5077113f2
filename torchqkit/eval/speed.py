"""Greedy decode speed of a causal LM, in new tokens per second (see Note [Decode timing])."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from .decode import LeanDecoder
from .perplexity import check_token_ids, logits_of, model_vocab_size

__all__ = ["decode_tokens_per_second", "DecodeLoop", "DECODE_LOOPS"]

# Note [Decode timing]
# ~~~~~~~~~~~~~~~~~~~~
# A run greedily generates `new_tokens` tokens after the prompt and records the wall-clock time at which
# each new token exists. The first one comes out of the prefill (the whole prompt in one pass), which
# is a different workload (matrix-matrix, not matrix-vector), so a run's rate is
#     (new_tokens - 1) / (time of the last token - time of the first token),
# i.e. decode steps only. One untimed run first absorbs one-time costs (allocations, lazy imports,
# kernel selection, and torch.compile of the lean loop's step: DecodeLoop.compile_seconds); the result
# is the rate of the run with the median duration among `repeats`. The loops (`decode=`):
#   "lean"      torchqkit.eval.LeanDecoder: static KV cache, one-token step, optionally compiled
#               (Note [Lean decode]); transformers causal LMs.
#   "generate"  transformers' generate(do_sample=False, min = max = new_tokens, so it never stops early at
#               an end-of-sequence token); the time stamps come from a stopping criterion that never stops
#               (it is called once per new token).
#   "recompute" any module returning logits: reruns the whole sequence each step (no KV cache to reuse).

DECODE_LOOPS = ("lean", "generate", "recompute")


class DecodeLoop:
    """One greedy decode loop over a fixed prompt, ready to run again and again (a lean loop compiles once).

    run(on_token) decodes `new_tokens` tokens and returns the time (time.perf_counter) at which each exists;
    on_token(i) is called at that moment; `tokens` then holds the run's new token ids. compile_seconds: how
    long the lean loop's first compiled step took (None until it ran, or when nothing is compiled).
    max_length: the lean loop's KV cache positions (default: prompt + new_tokens).
    filled_cache_attention: the lean loop's attention over the filled cache positions only (LeanDecoder's
    argument; None: its default, by max_length).
    kv_cache: a torchqkit.KVCacheConfig: the lean loop's cache is a quantized one (LeanDecoder's argument).
    """

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, new_tokens: int, *, decode: str = "lean",
                 compile: bool = False, inductor_options: dict | None = None, max_length: int | None = None,
                 filled_cache_attention: bool | None = None, kv_cache=None):
        if decode not in DECODE_LOOPS:
            raise ValueError(f"decode must be one of {', '.join(DECODE_LOOPS)}, got {decode!r}")
        if compile and decode != "lean":
            raise ValueError(f"compile=True compiles the lean loop's step; decode={decode!r} runs the model as it "
                             f"is (torch.compile the model yourself to time a compiled {decode} loop)")
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
            raise ValueError(f"new_tokens must be an int >= 2 (the first token comes from the prefill), "
                             f"got {new_tokens!r}")
        self.model, self.new_tokens, self.decode = model, new_tokens, decode
        self.tokens: list[int] = []
        self.ids = check_token_ids(input_ids, model_vocab_size(model)).unsqueeze(0)
        for tensor in model.parameters():
            self.ids = self.ids.to(tensor.device)
            break
        if max_length is not None and decode != "lean":
            raise ValueError(f"max_length sizes the lean loop's static KV cache; decode={decode!r} has none")
        if filled_cache_attention is not None and decode != "lean":
            raise ValueError(f"filled_cache_attention is the lean loop's; decode={decode!r} has no static KV cache")
        if kv_cache is not None and decode != "lean":
            raise ValueError(f"kv_cache quantizes the lean loop's KV cache; use decode='lean' (decode={decode!r})")
        self._decoder = (LeanDecoder(model, max_length or self.ids.shape[1] + new_tokens, compile=compile,
                                     inductor_options=inductor_options, filled_cache_attention=filled_cache_attention,
                                     kv_cache=kv_cache)
                         if decode == "lean" else None)

    @property
    def compile_seconds(self) -> float | None:
        return None if self._decoder is None else self._decoder.compile_seconds

    @property
    def attention(self) -> str | None:
        """The attention implementation the lean loop's last run ran (LeanDecoder.attention); None otherwise."""
        return None if self._decoder is None else self._decoder.attention

    @property
    def replay_off(self) -> str | None:
        """Why the compiled lean loop's last run called its steps through dynamo (None: they were replayed, or
        nothing is compiled). See Note [Step replay]."""
        return None if self._decoder is None else self._decoder.replay_off

    def run(self, on_token: Callable[[int], None] | None = None) -> list[float]:
        times: list[float] = []

        def stamp(i: int) -> None:
            times.append(time.perf_counter())
            if on_token is not None:
                on_token(i)

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                if self._decoder is not None:
                    new = self._decoder.generate(self.ids, self.new_tokens, on_token=stamp)
                elif self.decode == "generate":
                    new = _generate_run(self.model, self.ids, self.new_tokens, stamp)
                else:
                    new = _recompute_run(self.model, self.ids, self.new_tokens, stamp)
        finally:
            self.model.train(was_training)
        if len(times) != self.new_tokens:
            raise RuntimeError(f"the model generated {len(times)} tokens instead of {self.new_tokens}")
        self.tokens = new.reshape(-1).tolist()
        return times


def decode_tokens_per_second(model: nn.Module, input_ids: torch.Tensor, new_tokens: int = 32,
                             repeats: int = 3, *, decode: str = "lean", compile: bool = False,
                             inductor_options: dict | None = None, kv_cache=None) -> float:
    """Median greedy decode rate (tokens/s, prefill excluded) of `model` after the prompt `input_ids`.

    input_ids: the prompt, 1-d or (1, T) integer ids (at least 2 tokens). new_tokens >= 2: tokens generated
    per run. repeats >= 1: timed runs after one untimed warm-up run. decode: "lean" (transformers causal LMs),
    "generate" or "recompute" (any module returning logits); compile / inductor_options: compile the lean
    loop's step; kv_cache: a torchqkit.KVCacheConfig for the lean loop's cache. See Note [Decode timing] and
    Note [Lean decode].
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    loop = DecodeLoop(model, input_ids, new_tokens, decode=decode, compile=compile,
                      inductor_options=inductor_options, kv_cache=kv_cache)
    loop.run()
    durations = []
    for _ in range(repeats):
        times = loop.run()
        durations.append(times[-1] - times[0])
    return (new_tokens - 1) / statistics.median(durations)


def _generate_run(model: nn.Module, ids: torch.Tensor, new_tokens: int,
                  stamp: Callable[[int], None]) -> torch.Tensor:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stamps(StoppingCriteria):
        """Calls stamp(i) when new token i exists; never asks generation to stop."""

        def __init__(self):
            self.count = 0

        def __call__(self, input_ids, scores, **kwargs):
            stamp(self.count)
            self.count += 1
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "eos_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=new_tokens,
                   max_new_tokens=new_tokens, stopping_criteria=StoppingCriteriaList([_Stamps()]),
                   pad_token_id=pad)
    return out[0, ids.shape[1]:]


def _recompute_run(model: nn.Module, ids: torch.Tensor, new_tokens: int,
                   stamp: Callable[[int], None]) -> torch.Tensor:
    prompt = ids.shape[1]
    for i in range(new_tokens):
        next_id = logits_of(model, ids)[:, -1].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
        stamp(i)
    return ids[0, prompt:]
