"""Calling the graph torch.compile built for a decode step again without dynamo: see Note [Step replay]."""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ReplayingInductor", "STEP_INDUCTOR_DEFAULTS"]

# Inductor's wrapper checks the size and stride of every graph input and of every extern op's output with a Python
# call each (assert_size_stride, assert_alignment): ~850 per SmolLM2-135M step (benchmarks/bench_decode.py, 1 thread,
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


class ReplayingInductor:
    """A torch.compile backend: inductor with STEP_INDUCTOR_DEFAULTS updated by `options`, remembering the graph
    and arguments of its latest call."""

    def __init__(self, options: dict | None = None):
        self.options = {**STEP_INDUCTOR_DEFAULTS, **(options or {})}
        self._last: tuple[Callable, tuple, int] | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches=self.options)

        def run(*args):
            outputs = compiled(*args)
            self._last = (compiled, args, len(outputs))
            return outputs

        return run

    def forget(self) -> None:
        """Drop the recorded call (its arguments hold the step's tensors)."""
        self._last = None

    def bind(self, token: torch.Tensor, position: torch.Tensor) -> tuple[Callable | None, str | None]:
        """(replay(token, position) -> next token, None) for the graph call just made with `token` and `position`,
        or (None, why not)."""
        if self._last is None:
            return None, "the step did not call an inductor graph"
        compiled, args, n_outputs = self._last
        if n_outputs != 1:
            return None, f"the graph returns {n_outputs} values, not just the next token (the frame uses the others)"
        if not all(isinstance(a, torch.Tensor) for a in args):
            return None, "the compiled step takes symbolic sizes (a dynamic-shape recompile)"
        slots = [next((i for i, a in enumerate(args) if a is t), None) for t in (token, position)]
        if None in slots:
            return None, "the graph does not take the token and the position as inputs"
        token_slot, position_slot = slots
        base = list(args)

        def replay(next_token: torch.Tensor, next_position: torch.Tensor) -> torch.Tensor:
            inputs = base.copy()
            inputs[token_slot] = next_token
            inputs[position_slot] = next_position
            outputs = compiled(*inputs)
            return outputs[0]

        return replay, None
