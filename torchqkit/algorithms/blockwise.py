"""The sequential calibration runner: run a model's decoder blocks one at a time on calibration data.

Note [Block-by-block calibration]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Calibrating a whole model at once keeps every layer's statistics (GPTQ Hessians, activation samples) alive
together, and tools that do so run 0.6B models out of RAM. Instead the model runs once up to its first
decoder block, whose inputs (positional and keyword: attention masks, rotary embeddings) are captured per
batch; then each block in turn is run on those inputs to collect its statistics, quantized by the caller,
and run again (now quantized) to produce the next block's inputs. Peak extra memory is one block's
statistics plus the activations of the calibration batches. The blocks are the repeated module list (the
longest ``nn.ModuleList`` of modules of one class), or the one a user names; a model without one is a
single block. The runner knows nothing of quantization: the caller's ``calibrate_block`` does that.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["BlockInputs", "find_blocks", "capture_block_inputs", "run_block", "check_finite_activation"]

# Keyword arguments a decoder block receives that would make repeated runs change state (a KV cache
# grows on every call): captured as None / False. transformers 5.24 names the cache `cache`.
_STATEFUL_KWARGS = {"past_key_values": None, "past_key_value": None, "cache": None, "use_cache": False}


@dataclass
class BlockInputs:
    """One calibration batch as a block sees it: positional and keyword arguments."""
    args: tuple
    kwargs: dict


class _StopForward(Exception):
    """Raised by the capture hook once the first block's inputs are recorded: the rest need not run."""


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, list[nn.Module]]:
    """(fqn of the module list, its blocks). ``name``: the fqn of an ``nn.ModuleList`` (or nn.Sequential) to use;
    None: the longest ModuleList whose children are all of one class (at least two), else the whole model."""
    modules = dict(model.named_modules())
    if name is not None:
        if name not in modules:
            raise ValueError(f"calibration blocks {name!r}: the model has no module of that name; pass the fqn of "
                             f"its decoder-layer list, e.g. 'model.layers'")
        blocks = modules[name]
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            raise ValueError(f"calibration blocks {name!r} is a {type(blocks).__name__}, not a non-empty "
                             f"nn.ModuleList / nn.Sequential of decoder blocks")
        return name, list(blocks)
    best = None
    for fqn, module in modules.items():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best[1]):
                best = (fqn, list(module))
    return best if best is not None else ("", [model])


def _as_call(batch) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def capture_block_inputs(model: nn.Module, first: nn.Module, batches: Iterable) -> list[BlockInputs]:
    """Run ``model`` on each batch up to ``first`` and return what ``first`` was called with, per batch. When
    ``first`` is the model itself the batches are its inputs as they are."""
    captured: list[BlockInputs] = []
    if first is model:
        return [BlockInputs(*_as_call(b)) for b in batches]

    def hook(module, args, kwargs):
        kwargs = {k: (_STATEFUL_KWARGS[k] if k in _STATEFUL_KWARGS else v) for k, v in kwargs.items()}
        captured.append(BlockInputs(tuple(args), kwargs))
        raise _StopForward

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                args, kwargs = _as_call(batch)
                try:
                    model(*args, **kwargs)
                except _StopForward:
                    continue
                raise ValueError(f"calibration batch {i} ran through the model without reaching its first block "
                                 f"({type(first).__name__}); name the blocks the model really runs")
    finally:
        handle.remove()
    if not captured:
        raise ValueError("calibration_data is empty: pass at least one batch of model inputs")
    return captured


def run_block(block: nn.Module, inputs: list[BlockInputs]) -> list[BlockInputs]:
    """Run ``block`` on every captured input; the outputs become the next block's inputs (hidden states first,
    the other arguments unchanged)."""
    outputs = []
    with torch.no_grad():
        for inp in inputs:
            out = block(*inp.args, **inp.kwargs)
            hidden = out[0] if isinstance(out, (tuple, list)) else out
            if inp.args:
                outputs.append(BlockInputs((hidden, *inp.args[1:]), inp.kwargs))
            else:  # hidden states passed by keyword
                key = next(iter(inp.kwargs))
                outputs.append(BlockInputs((), {**inp.kwargs, key: hidden}))
    return outputs


def check_finite_activation(x: torch.Tensor, fqn: str) -> None:
    """Calibration statistics of NaN / Inf activations are meaningless: fail naming the module."""
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"calibration: the input of {fqn} has {bad} NaN/Inf value(s); the model (or the "
                         f"calibration data) produces non-finite activations there, so no statistics can be taken. "
                         f"Check the data and the float model; nothing was changed")
