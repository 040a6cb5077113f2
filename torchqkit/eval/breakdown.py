"""Where a decode step's time goes: kernels (quantized linears, float matmuls, attention) versus the rest
(Python, dispatch, norms, rotary embeddings, sampling, generate's bookkeeping). See Note [Decode breakdown]."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

from .speed import DecodeLoop

__all__ = ["DecodeBreakdown", "decode_breakdown", "KERNEL_GROUPS"]

# Note [Decode breakdown]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Wall time per token comes from unprofiled runs of the loop (median of `repeats`, decode steps only, as in
# Note [Decode timing]). Kernel time per token comes from one more run under torch.profiler, started when
# the prefill's token exists and stopped at the last token: the self CPU time of the ops in KERNEL_GROUPS,
# divided by the decode steps. Self time of a multi-threaded op is its wall time on the calling thread
# (workers included, since it waits for them). "rest" = wall - kernels: everything else a step does. The
# profiler adds a few microseconds per recorded op, which is why the wall time is not taken from that run.
# On a busy host the profiled run can be slower than the median of the others: "rest" then comes out small
# or even negative, a sign to measure again on a quieter machine, not an error to hide.
# Under torch.compile the norms, rotary embeddings and softmax run inside inductor's generated C++ (not
# separate profiler events), so they count as "rest" there; the quantized linears stay visible because
# they are calls of torchqkit's custom ops.

KERNEL_GROUPS = {
    "quantized linears": ("torchqkit::linear_*", "torchqkit::scaled_mm_*"),
    "float matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "torchqkit::sdpa_over_filled_cache"),
}


@dataclass(frozen=True)
class DecodeBreakdown:
    """Milliseconds per decode step: `total` (wall), `kernels` per KERNEL_GROUPS name, `rest` = total - kernels."""
    total: float
    kernels: dict[str, float]
    rest: float
    calls_per_token: dict[str, float]

    def __str__(self) -> str:
        parts = [f"{name} {ms:.2f} ms ({self.calls_per_token[name]:.0f} calls)" for name, ms in self.kernels.items()
                 if self.calls_per_token[name]]
        return f"{self.total:.2f} ms/token = " + " + ".join(parts + [f"rest {self.rest:.2f} ms"])


def decode_breakdown(loop: DecodeLoop, repeats: int = 3) -> DecodeBreakdown:
    """Time per decode step of `loop` split into kernel groups and the rest (Note [Decode breakdown]).
    The loop should have run once already (warm-up, compile)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    steps = loop.new_tokens - 1
    walls = []
    for _ in range(repeats):
        times = loop.run()
        walls.append((times[-1] - times[0]) / steps * 1e3)
    prof = profile(activities=[ProfilerActivity.CPU])

    def on_token(i: int) -> None:
        if i == 0:
            prof.start()
        elif i == steps:
            prof.stop()

    loop.run(on_token)
    self_us = {name: 0.0 for name in KERNEL_GROUPS}
    calls = {name: 0 for name in KERNEL_GROUPS}
    for event in prof.key_averages():
        for name, prefixes in KERNEL_GROUPS.items():
            if any(event.key == p or (p.endswith("*") and event.key.startswith(p[:-1])) for p in prefixes):
                self_us[name] += event.self_cpu_time_total
                calls[name] += event.count
    total = statistics.median(walls)
    kernels = {name: us / 1e3 / steps for name, us in self_us.items()}
    return DecodeBreakdown(total, kernels, total - sum(kernels.values()),
                           {name: n / steps for name, n in calls.items()})
