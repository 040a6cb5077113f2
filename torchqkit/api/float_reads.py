"""The report's note when a float weight left in the model is the biggest read of every forward pass.

Note [Float reads per token]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Decoding one token reads every Linear's whole weight once, so a weight's bytes are its share of the memory
traffic of a decode step, which on CPUs is most of its time. A Linear left in float (kept: a tied lm_head,
a None config; or skipped) can then cost more than all the quantized ones together: SmolLM2-135M's tied
49152 x 576 lm_head is 113 MB in float32, 1.4x its 210 int4 g32 Linears (float32 scales). The report says so,
bytes-based and always, when one float Linear-like weight reads at least FLOAT_SHARE_NOTED of what the quantized
Linear-like weights read together, and names the way out (an output-layer preset, or naming the module).
Embeddings are not counted: a lookup reads only its rows.
"""
from __future__ import annotations

from torch import nn

from .weight_modules import is_linear_like

__all__ = ["float_read_notes", "FLOAT_SHARE_NOTED"]

FLOAT_SHARE_NOTED = 0.5


def float_read_notes(report, modules: dict[str, nn.Module], holders: dict, configs) -> list[str]:
    """The notes for ``report`` (at most one: the largest float weight), see Note [Float reads per token]."""
    linear = [e for e in report.entries if e.fqn in modules and is_linear_like(modules[e.fqn])]
    quantized = [e for e in linear if e.status == "quantized"]
    left = [e for e in linear if e.status in ("kept", "skipped") and e.bytes_before > 0]
    if not quantized or not left:
        return []
    q_bytes = sum(e.bytes_after for e in quantized)
    biggest = max(left, key=lambda e: e.bytes_before)
    if biggest.bytes_before < FLOAT_SHARE_NOTED * q_bytes:
        return []
    weight = modules[biggest.fqn].weight
    tied = [h.fqn for h in holders.get(id(weight), []) if h.module is not modules[biggest.fqn]]
    name = biggest.fqn + (f" (tied to {', '.join(tied)})" if tied else "")
    dtype = str(weight.dtype).removeprefix("torch.")
    default = configs.lookup(biggest.fqn)[1] or configs.configs.get("_default")
    mine = "<your config>" if default is None else f"{type(default).__name__}(...)"
    return [f"{name} stays {dtype}: {_size(biggest.bytes_before)} read per token, "
            f"{biggest.bytes_before / q_bytes:.1f}x all {len(quantized)} quantized Linears together "
            f"({_size(q_bytes)}); quantize it at 8 bits with the preset 'int4-wo-g32-out8' or "
            f"ModuleConfigs({{'{biggest.fqn}': Int8WeightOnlyConfig(), '_default': {mine}}})"]


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
