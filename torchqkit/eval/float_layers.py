"""How much of a decode step the float Linears left in a quantized model take, measured. See
Note [Float layer time].

Note [Float layer time]
~~~~~~~~~~~~~~~~~~~~~~~
The report counts bytes (Note [Float reads per token] in api/float_reads.py); this measures time. One more
decode run goes under torch.profiler with input shapes recorded, from the prefill's token to the last one
(as Note [Decode breakdown]); the self time of every float matmul (aten::mm / addmm / linear / matmul) whose
weight operand has a float Linear's shape, (in, out) or (out, in), is that Linear's time, divided by the
decode steps. The wall time per step comes from the loop's unprofiled runs. Linears of one shape are
reported together. Under --compile inductor runs a float matmul inside its generated code, out of the
profiler's sight; for a shape the profiler did not see, the same matmul (one token's activation times the
layer's weight, ``F.linear``, with the step's threads) is timed on its own instead: the median of
ALONE_REPEATS calls after a warm-up, times the layers of that shape. ``how`` says which was done.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ..api.weight_modules import is_linear_like
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .speed import DecodeLoop

__all__ = ["FloatLayerTime", "float_linears", "float_layer_time", "FLOAT_MATMULS", "ALONE_REPEATS"]

FLOAT_MATMULS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")
ALONE_REPEATS = 20
PROFILED = "profiled in the decode loop"
ALONE = "its matmul timed alone: the compiled step hides it from the profiler"


@dataclass(frozen=True)
class FloatLayerTime:
    """``ms``: milliseconds per decode step of the matmuls on ``names``' weights (shape ``shape``, (out, in));
    ``calls``: their calls per step (as many as layers when timed alone); ``how``: profiled in the loop, or
    timed alone (Note [Float layer time])."""
    names: tuple[str, ...]
    shape: tuple[int, int]
    dtype: str
    ms: float
    calls: float
    how: str


def float_linears(model: nn.Module) -> dict[tuple[int, int], list[tuple[str, torch.Tensor]]]:
    """(out, in) -> [(name, its (out, in) float weight)] of the Linear-like modules whose weight is still float;
    a weight held by several of them (a tie) once."""
    found: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
    seen: set[int] = set()
    for fqn, module in model.named_modules():
        w = getattr(module, "weight", None)
        if (not is_linear_like(module) or not isinstance(w, torch.Tensor) or isinstance(w, AffineQuantizedTensor)
                or id(w) in seen):
            continue
        seen.add(id(w))
        w = w.detach()
        w = w.reshape(w.shape[0], w.shape[1]) if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) else w.t()
        found.setdefault((w.shape[0], w.shape[1]), []).append((fqn, w))  # GPT-2's Conv1D stores (in, out)
    return found


def float_layer_time(loop: DecodeLoop, model: nn.Module) -> list[FloatLayerTime]:
    """Per (out, in) shape of the float Linears left in ``model``: their measured time per decode step of
    ``loop`` (which should have run once: warm-up, compile). Empty when no float Linear is left."""
    linears = float_linears(model)
    if not linears:
        return []
    steps = loop.new_tokens - 1
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def on_token(i: int) -> None:
        if i in (0, steps):
            with _native_stderr_silenced():
                prof.start() if i == 0 else prof.stop()

    loop.run(on_token)
    us = {shape: 0.0 for shape in linears}
    calls = {shape: 0 for shape in linears}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in FLOAT_MATMULS:
            continue
        shape = _weight_shape(event.input_shapes, linears)
        if shape is not None:
            us[shape] += event.self_cpu_time_total  # linear -> matmul -> mm: each its own share
            calls[shape] += event.count if event.key in ("aten::mm", "aten::addmm") else 0
    out = []
    for shape, named in linears.items():
        names, dtype = tuple(n for n, _ in named), str(named[0][1].dtype).removeprefix("torch.")
        if calls[shape]:
            out.append(FloatLayerTime(names, shape, dtype, us[shape] / 1e3 / steps, calls[shape] / steps, PROFILED))
        else:
            out.append(FloatLayerTime(names, shape, dtype, len(named) * _alone_ms(named[0][1]), len(named), ALONE))
    return out


def _alone_ms(weight: torch.Tensor) -> float:
    """Median milliseconds of one decode token's ``F.linear`` on ``weight`` (Note [Float layer time])."""
    x = torch.randn(1, 1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    times = []
    with torch.no_grad():
        for i in range(ALONE_REPEATS + 2):  # two warm-up calls
            start = time.perf_counter()
            F.linear(x, weight)
            if i >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def _native_stderr_silenced():
    """Kineto writes a line to file descriptor 2 at each profiler start and stop (whatever Python's sys.stderr
    is); the CLI's stderr is for its own progress and errors, so those lines go to os.devnull."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _weight_shape(input_shapes, linears) -> tuple[int, int] | None:
    """The float Linear shape one of the op's operands has: (in, out) for mm / addmm on W.t(), (out, in) for
    linear; None when no operand matches."""
    for s in input_shapes or ():
        if isinstance(s, (list, tuple)) and len(s) == 2:
            if (s[1], s[0]) in linears:
                return (s[1], s[0])
            if tuple(s) in linears:
                return tuple(s)
    return None
