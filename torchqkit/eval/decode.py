"""A lean greedy decode loop for transformers causal LMs: a static KV cache and a one-token step that
torch.compile turns into one graph (see Note [Lean decode]).

    from torchqkit.eval import LeanDecoder, greedy_decode
    ids = greedy_decode(model, prompt_ids, 32, compile=True)          # (1, prompt + 32), like generate()
    decoder = LeanDecoder(model, max_length=256, compile=True)       # reuse the compiled step across prompts
    new = decoder.generate(prompt_ids, 32)                            # (32,) new token ids
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import torch
from torch import nn

from ..kvcache import register_quantized_kv_attention
from .filled_cache_attention import filled_cache_pays, register_filled_cache_sdpa
from .perplexity import check_token_ids, model_vocab_size
from .step_replay import ReplayingInductor

__all__ = ["LeanDecoder", "greedy_decode", "CPU_STEP_INDUCTOR_DEFAULTS"]

CPU_STEP_INDUCTOR_DEFAULTS = {"cpp_wrapper": True}  # see the note on inductor options below

# Note [Lean decode]
# ~~~~~~~~~~~~~~~~~~
# HF generate() spends ~20 ms per token of a 135M model in Python: logits processors, stopping criteria,
# cache bookkeeping, the model's own mask and position code, and one dispatcher trip per op. The loop here
# keeps only what greedy decoding needs:
#   1. prefill: one eager forward over the prompt writes the StaticCache (fixed-size K/V tensors, so every
#      later step has the same shapes) and gives the first token (argmax of the last logits);
#   2. each step feeds one token at `cache_position` and takes the argmax. With compile=True the step is
#      `torch.compile(fullgraph=True)`: the whole model forward, mask, cache write and argmax are one
#      inductor graph in which the quantized linears are calls of torchqkit's custom ops (a graph break
#      raises instead of running half eager).
# Dynamo checks a guard per parameter and per tensor-subclass field before each call, milliseconds for a
# model with hundreds of quantized weights. The first step of every generate() call runs with all guards
# (a changed model recompiles there); the following steps of that call skip dynamo altogether and call the
# inductor graph the first step ran, with that step's inputs and the new token and position (Note [Step
# replay] in step_replay.py): nothing the guards check can change between two steps of one call, because the
# loop alone runs the model. Where replay is not possible (`replay_off` says why) those steps run through
# dynamo under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`. skip_guards=False keeps every guard
# and every step goes through dynamo.
# With a StaticCache every step attends over max_length positions; with torchqkit's attention (always where its C++
# kernel serves, from 256 positions on elsewhere) the step attends over the filled ones only (Note [Filled-cache
# attention]), so a large max_length costs memory, not time.
# Decoding runs under torch.inference_mode(), not just no_grad: inference mode takes the autograd keys out of
# dispatch, so each of the ~200 custom-op calls per token skips the Python autograd kernel that
# torch.library.register_autograd installs (it only checks that nothing needs a gradient, then redispatches).
# benchmarks/RESULTS.md has that kernel at 5-8 us of CPU per call. The returned ids are cloned out
# of inference mode, so callers can modify them.
# Tokens equal generate(do_sample=False) with min_new_tokens = max_new_tokens (no early stop at
# end-of-sequence), up to ties in argmax that a different summation order can flip.

# Inductor options are passed per compile (torch.compile(options=...)), never set globally: inductor's own
# settings, less the wrapper's size / stride asserts (STEP_INDUCTOR_DEFAULTS in step_replay.py, which says why),
# and on CPU the C++ wrapper (CPU_STEP_INDUCTOR_DEFAULTS): the generated code that calls the step's ~270 kernels and
# custom ops is C++ instead of Python, which takes about 0.4 ms off each SmolLM2-135M token (1.09x tokens/s in
# alternating rounds, python -m benchmarks decode --alternate, Intel Xeon, 2 threads) for a longer first compile
# (62 s instead of 33 s with an empty inductor cache). inductor_options={"cpp_wrapper": False} restores the Python one.


class LeanDecoder:
    """Greedy decoding of a transformers causal LM (batch 1) with a static KV cache of `max_length` positions.

    model: a transformers causal LM whose forward takes a cache (`cache` since transformers 5.24, `past_key_values`
        before), `cache_position` and `position_ids`
        (LLaMA, Mistral, Qwen2, ... under transformers' StaticCache). It is used as it is (eval mode is the
        caller's choice; decoding runs under torch.no_grad()).
    max_length: prompt + new tokens of the longest request; the K/V cache holds that many positions.
    compile: torch.compile(fullgraph=True) the one-token step. The first step compiles (seconds to a minute:
        `compile_seconds` says how long); a graph break raises.
    inductor_options: inductor settings for this compile only, e.g. {"freezing": True}, on top of
        STEP_INDUCTOR_DEFAULTS (no size / stride asserts in the step's wrapper; {"size_asserts": True} restores them)
        and, for a model on the CPU, CPU_STEP_INDUCTOR_DEFAULTS (the wrapper in C++; {"cpp_wrapper": False} for
        inductor's Python one, which compiles in about half the time).
    skip_guards: after the first step of each call, call the compiled graph without dynamo (or, where that is
        not possible, skip dynamo's guard checks); see Note [Lean decode].
    filled_cache_attention: while decoding, a model on transformers' "sdpa" attention attends over the filled
        cache positions only (Note [Filled-cache attention]); None (default): where that pays (filled_cache_pays:
        always with the C++ CPU kernel, from 256 positions on with the Python reference). Other attention
        implementations are left as they are. Not used with `kv_cache`.
    kv_cache: a torchqkit.KVCacheConfig: the cache is a static torchqkit.QuantizedKVCache of that format (keys and
        values stored quantized, read by attention from their codes); the model must run "sdpa" attention, which
        the decoder switches to the quantized cache's attention while it decodes. None (default): transformers'
        StaticCache in the model's dtype.

    After generate(): `attention` names the attention implementation the call ran; `replayed_steps` is how many
    of its steps called the graph without dynamo; `replay_off` says why none could (None when they did, or when
    the decoder is eager or keeps its guards); `replay_calls` which graph they called ("inductor": inductor's own,
    the usual case; "aot_autograd": the wrapper around it, Note [Inner replay] in step_replay.py).
    """

    def __init__(self, model: nn.Module, max_length: int, *, compile: bool = False,
                 inductor_options: dict | None = None, skip_guards: bool = True,
                 filled_cache_attention: bool | None = None, kv_cache=None):
        _check_model(model)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2 (prompt + new tokens), got {max_length!r}")
        if inductor_options and not compile:
            raise ValueError("inductor_options are for the compiled step: pass compile=True or drop them")
        from transformers import StaticCache

        self.model = model
        self.max_length = max_length
        self.compiled = compile
        self.skip_guards = skip_guards and compile
        self.compile_seconds: float | None = None
        self.replayed_steps = 0
        self.replay_off: str | None = None
        self.replay_calls: str | None = None
        self.filled_cache_attention = (filled_cache_pays(max_length, _device_of(model))
                                       if filled_cache_attention is None else bool(filled_cache_attention))
        self.attention: str | None = None
        self.kv_cache = kv_cache
        if kv_cache is None:
            self._cache = StaticCache(config=model.config, max_cache_len=max_length)
        else:
            self._cache = _quantized_cache(model, kv_cache, max_length)
            self.filled_cache_attention = False
        self._cache_arg = cache_argument(model)
        device_defaults = CPU_STEP_INDUCTOR_DEFAULTS if _device_of(model).type == "cpu" else {}
        self._backend = ReplayingInductor({**device_defaults, **(inductor_options or {})}) if compile else None
        # dynamic=False: another cache length gets its own static graph; after a recompile dynamo would otherwise
        # make the length symbolic, a graph that replay cannot call (Note [Step replay]) and that runs slower.
        self._step = (torch.compile(self._forward_one, fullgraph=True, dynamic=False, backend=self._backend)
                      if compile else self._forward_one)

    def generate(self, input_ids: torch.Tensor, new_tokens: int, *,
                 on_token: Callable[[int], None] | None = None) -> torch.Tensor:
        """The `new_tokens` greedy token ids (1-d) after the prompt `input_ids` (1-d or (1, T)).

        on_token(i) is called as soon as new token i exists (0 = the prefill's), e.g. to time each token.
        """
        ids = check_token_ids(input_ids, model_vocab_size(self.model)).unsqueeze(0)
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
            raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}")
        prompt = ids.shape[1]
        if prompt + new_tokens > self.max_length:
            raise ValueError(f"a {prompt}-token prompt + {new_tokens} new tokens needs {prompt + new_tokens} cache "
                             f"positions; this LeanDecoder holds max_length={self.max_length}: build one with a "
                             f"larger max_length")
        device = _device_of(self.model)
        ids = ids.to(device)
        own = getattr(self.model.config, "_attn_implementation", None)
        try:
            if self.kv_cache is not None:
                self.model.set_attn_implementation(register_quantized_kv_attention())
            elif self.filled_cache_attention and own == "sdpa":
                self.model.set_attn_implementation(register_filled_cache_sdpa())
            # What the model now runs (a model that cannot switch keeps its own, with transformers' warning).
            self.attention = getattr(self.model.config, "_attn_implementation", None)
            with torch.inference_mode():
                out = self._decode(ids, prompt, new_tokens, device, on_token)
        finally:
            if getattr(self.model.config, "_attn_implementation", None) != own:
                self.model.set_attn_implementation(own)
            if self._backend is not None:
                self._backend.forget()  # the recorded step arguments hold this call's tensors
        return out.clone()  # a normal tensor: the caller may modify it outside inference mode

    def _decode(self, ids, prompt: int, new_tokens: int, device, on_token) -> torch.Tensor:
        out = torch.empty(new_tokens, dtype=torch.long, device=device)
        self._cache.reset()
        positions = torch.arange(prompt, device=device)
        logits = self.model(input_ids=ids, cache_position=positions, position_ids=positions.unsqueeze(0),
                            **{self._cache_arg: self._cache}, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        out[0] = token[0, 0]
        if on_token is not None:
            on_token(0)
        self.replayed_steps = 0
        replay = None
        for i in range(1, new_tokens):
            position = torch.tensor([prompt + i - 1], device=device)
            if replay is not None:
                token = replay(token, position)
                self.replayed_steps += 1
            elif i == 1:
                step_input = token
                token = self._timed_step(token, position)
                replay = self._bind_replay(step_input, position)
            elif self.skip_guards:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    token = self._step(token, position)
            else:
                token = self._step(token, position)
            out[i] = token[0, 0]
            if on_token is not None:
                on_token(i)
        return out

    def _bind_replay(self, token: torch.Tensor, position: torch.Tensor):
        """The replay of the step just run (Note [Step replay]), or None (and why in `replay_off`)."""
        if not self.skip_guards:
            return None
        replay, self.replay_off = self._backend.bind(token, position)
        self.replay_calls = self._backend.replay_calls if replay is not None else None
        return replay

    def _timed_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if not self.compiled or self.compile_seconds is not None:
            return self._step(token, position)
        start = time.perf_counter()
        token = self._step(token, position)
        self.compile_seconds = time.perf_counter() - start
        return token

    def _forward_one(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=token, cache_position=position, position_ids=position.unsqueeze(0),
                            **{self._cache_arg: self._cache}, use_cache=True, logits_to_keep=1).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)


def greedy_decode(model: nn.Module, input_ids: torch.Tensor, new_tokens: int, *, compile: bool = False,
                  inductor_options: dict | None = None, kv_cache=None) -> torch.Tensor:
    """Prompt + `new_tokens` greedy tokens, shape (1, T + new_tokens), as HF generate(do_sample=False) returns
    them, through a LeanDecoder (see Note [Lean decode]; `kv_cache`: a torchqkit.KVCacheConfig for a quantized KV
    cache). To decode several prompts with one compiled step, build a LeanDecoder once and call its generate()."""
    ids = check_token_ids(input_ids, model_vocab_size(model)).unsqueeze(0)
    decoder = LeanDecoder(model, ids.shape[1] + new_tokens, compile=compile, inductor_options=inductor_options,
                          kv_cache=kv_cache)
    new = decoder.generate(ids, new_tokens)
    return torch.cat([ids.to(new.device), new.unsqueeze(0)], dim=1)


def _quantized_cache(model: nn.Module, kv_cache, max_length: int):
    """A static QuantizedKVCache for `model`, leaving the model's attention as it was (generate() switches it)."""
    from ..kvcache import KVCacheConfig
    from ..kvcache.cache import QuantizedKVCache

    if not isinstance(kv_cache, KVCacheConfig):
        raise TypeError(f"kv_cache must be a torchqkit.KVCacheConfig or None, got {type(kv_cache).__name__}")
    own = getattr(model.config, "_attn_implementation", None)
    cache = QuantizedKVCache(model.config, kv_cache, max_length=max_length, static=True)
    model.config._attn_implementation = own
    return cache


def cache_argument(model: nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by: `cache` (transformers >= 5.24) or
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    params = inspect.signature(model.forward).parameters
    # transformers 5 passes cache_position through **kwargs; a forward without **kwargs must name each one.
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    cache = cache_argument(model)
    missing = [name for name in (cache, "cache_position", "position_ids")
               if name not in params and not (takes_kwargs and name != cache)]
    if config is None or missing:
        what = "no `config`" if config is None else f"a forward without {', '.join(missing)}"
        raise TypeError(f"LeanDecoder decodes transformers causal LMs with a static KV cache; "
                        f"{type(model).__name__} has {what}. Use decode='generate' (HF generate) or "
                        f"decode_tokens_per_second's recompute loop for other modules")


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")
