"""Calling the graph torch.compile built for a decode step again without dynamo: see Note [Step replay]."""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ReplayingInductor", "STEP_INDUCTOR_DEFAULTS"]

# Inductor's wrapper checks the size and stride of every graph input and of every extern op's output with a Python
# call each (assert_size_stride, assert_alignment): ~850 per SmolLM2-135M step (python -m benchmarks decode, 1 thread,
# default vs --inductor with the three asserts on, alternated: 116.7 / 119.0 vs 109.2 / 111.8 tok/s). A decode
# step's inputs are the tensors dynamo's guards checked on the first step of the call (replay passes the very same
# ones), and the custom ops' output shapes are their fake kernels' (tested against the real ones), so the loop
# compiles without them. Options given to LeanDecoder(inductor_options=...) override these.
STEP_INDUCTOR_DEFAULTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}

# Note [Step replay]
# ~~~~~~~~~~~~~~~~~~
# Before every call of a compiled function dynamo looks up its cache entry and runs the entry's bytecode,
# which gathers the graph's inputs (the token, the position, every parameter and inner tensor of the quantized
# weights, the K/V cache tensors: ~360 for SmolLM2-135M) and calls inductor's graph. Even with
# `skip_guard_eval_unsafe` the lookup still checks every tensor input (dynamo keeps tensor guards in its
# "diff" guard set): 1.7 ms of a 10 ms SmolLM2 step, measured with torch.profiler ("TorchDynamo Cache Lookup").
# Within one generate() call nothing those inputs are can change between two steps (the loop alone runs the
# model, and the cache and the weights are updated in place), so after the first step of a call, which runs
# through dynamo with all guards (a changed model recompiles there), the loop calls the same inductor graph
# with the same inputs, swapping in the new token and position.
# The backend below is inductor (compile_fx with the caller's options, as torch.compile(options=...) runs it)
# wrapped so that each graph call records its arguments. Replay needs three facts, checked at bind time:
# every argument is a tensor (no symbolic sizes that a step could change), the step's token and position
# are among them (found by identity), and the graph returns the next token only (more outputs would be
# values dynamo's bytecode does something with). Otherwise the loop keeps calling through dynamo, and says so in
# LeanDecoder.replay_off. What replay cannot check is Python state the compiled frame sets after the
# graph (dynamo's side-effect bytecode): a step of a transformers model under a StaticCache sets none, and
# the tests compare the tokens with generate()'s.

# Note [Inner replay]
# ~~~~~~~~~~~~~~~~~~~
# The graph dynamo calls is AOTAutograd's wrapper around inductor's: for a model with quantized weights it
# flattens every tensor-subclass input into its inner tensors on each call (~360 -> 396 inputs for SmolLM2-135M)
# before inductor's own wrapper turns them into handles for the C++ code. Replay calls inductor's graph directly
# with the flattened inputs recorded on the step's graph call (inner_compile wraps the compiled graph's
# `current_callable`), which took about 0.1 ms off each SmolLM2 token (1.04x tokens/s, the two replays alternated
# in one process by a scratch script, Intel Xeon, 2 threads). That is only sound where AOTAutograd's wrapper does nothing else: the inner graph returns
# the next token and nothing more (no mutated inputs for the wrapper to copy back, no outputs to re-wrap) and takes
# the token and position themselves (by identity); else replay calls the outer graph as before. AOTAutograd's
# cache is off for this backend's compiles: a cache hit returns a graph that never went through inner_compile
# (inductor's own FX graph cache still serves: a warm SmolLM2 compile took ~11 s instead of ~7). Greedy decoding
# has no RNG inputs; effect tokens or mutations AOTAutograd keeps outside the graph show up as more outputs.


class ReplayingInductor:
    """A torch.compile backend: inductor with STEP_INDUCTOR_DEFAULTS updated by `options`, remembering the graph
    and arguments of its latest call, and those of the inductor graph inside it (Note [Inner replay]).
    `replay_calls` says which graph the latest bind() replays: "inductor" (its own graph, inputs flattened) or
    "aot_autograd" (the wrapper around it)."""

    def __init__(self, options: dict | None = None):
        self.options = {**STEP_INDUCTOR_DEFAULTS, **(options or {})}
        self._last: tuple[Callable, tuple, int] | None = None
        self._inner: tuple[Callable, list, int] | None = None
        self.replay_calls: str | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph, inputs, **kwargs):
            output_code = compile_fx_inner(graph, inputs, **kwargs)
            self._record_inner_calls(output_code)
            return output_code

        # AOTAutograd's cache would hand back a graph compiled without inner_compile (Note [Inner replay])
        with torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=self.options)

        def run(*args):
            self._inner = None
            outputs = compiled(*args)
            self._last = (compiled, args, len(outputs))
            return outputs

        return run

    def _record_inner_calls(self, output_code) -> None:
        call = getattr(output_code, "current_callable", None)
        if call is None:  # not a CompiledFxGraph: replay stays at the outer graph
            return

        def recording(args: list):
            flat = list(args)  # inductor's call empties the list it gets
            outputs = call(args)
            self._inner = (call, flat, len(outputs))
            return outputs

        output_code.current_callable = recording

    def forget(self) -> None:
        """Drop the recorded call (its arguments hold the step's tensors)."""
        self._last = self._inner = None

    def bind(self, token: torch.Tensor, position: torch.Tensor) -> tuple[Callable | None, str | None]:
        """(replay(token, position) -> next token, None) for the graph call just made with `token` and `position`,
        or (None, why not)."""
        if self._last is None:
            return None, "the step did not call an inductor graph"
        compiled, args, n_outputs = self._last
        if n_outputs != 1:
            return None, f"the graph returns {n_outputs} values, not just the next token (the frame uses the others)"
        inner = self._inner_call(token, position)
        self.replay_calls = "inductor" if inner is not None else "aot_autograd"
        if inner is not None:
            return inner, None
        return self._outer_call(compiled, args, token, position)

    @staticmethod
    def _slots(args, token: torch.Tensor, position: torch.Tensor) -> tuple[int, int] | None:
        if not all(isinstance(a, torch.Tensor) for a in args):
            return None
        slots = [next((i for i, a in enumerate(args) if a is t), None) for t in (token, position)]
        return None if None in slots else (slots[0], slots[1])

    def _inner_call(self, token: torch.Tensor, position: torch.Tensor) -> Callable | None:
        # Note [Inner replay]: only where nothing between the two graphs can matter, else None (the outer replay).
        if self._inner is None:
            return None
        call, flat, n_outputs = self._inner
        slots = self._slots(flat, token, position)
        if n_outputs != 1 or slots is None:
            return None
        token_slot, position_slot = slots

        def replay(next_token: torch.Tensor, next_position: torch.Tensor) -> torch.Tensor:
            inputs = flat.copy()
            inputs[token_slot] = next_token
            inputs[position_slot] = next_position
            return call(inputs)[0]

        return replay

    def _outer_call(self, compiled: Callable, args: tuple, token: torch.Tensor,
                    position: torch.Tensor) -> tuple[Callable | None, str | None]:
        if not all(isinstance(a, torch.Tensor) for a in args):
            return None, "the compiled step takes symbolic sizes (a dynamic-shape recompile)"
        slots = self._slots(args, token, position)
        if slots is None:
            return None, "the graph does not take the token and the position as inputs"
        token_slot, position_slot = slots
        base = list(args)

        def replay(next_token: torch.Tensor, next_position: torch.Tensor) -> torch.Tensor:
            inputs = base.copy()
            inputs[token_slot] = next_token
            inputs[position_slot] = next_position
            return compiled(*inputs)[0]

        return replay, None
