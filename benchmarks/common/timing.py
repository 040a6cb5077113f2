"""Timing a call: warm-up, then the median (or another statistic) of repeated calls, each call optionally on the next
copy of its weights from a ring larger than the caches (memory.RING_BYTES), as the layers of a decoder step read
theirs from memory while the code, the activation and the threads stay warm. (Flushing the caches before each call
instead charges every call 0.1-0.2 ms of cold Python / dispatcher / thread wake-up that no model sees.)"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from .memory import RING_BYTES


def _p25(times):
    return sorted(times)[len(times) // 4]


# How a cell's calls become one figure: the median; on a host shared with other jobs the median measures the
# neighbours, so also the fastest call (what the kernel needs when it has the core) and the 25th percentile.
STATS: dict[str, Callable] = {"median": statistics.median, "min": min, "p25": _p25}


@dataclass
class Timer:
    """stat: a STATS name. cpu_time: each call's figure is this thread's CPU time (time.thread_time), which time spent
    descheduled by a loaded host's other jobs does not inflate (meaningful with one torch thread only)."""
    min_reps: int = 5
    budget_s: float = 1.0
    max_reps: int = 50
    stat: str = "median"
    cpu_time: bool = False
    ring_bytes: int = RING_BYTES

    def __call__(self, fn, *weights, cold: bool = False, nbytes: int | None = None) -> float:
        """Seconds of fn(*weights): `stat` over at least min_reps calls, more while under budget_s.
        cold: each call takes the next copy of `weights` from a ring of ring_bytes or more (weights from memory).
        nbytes: the stored bytes of one copy, when `weights` aren't tensors whose bytes weights.stored_bytes counts."""
        from .weights import stored_bytes
        fn(*weights)  # warm-up: allocations, lazy init (before the copies: the ring starts with the oldest)
        ring = [weights]
        if cold:
            per_copy = max(1, nbytes or sum(stored_bytes(w) for w in weights))
            ring += [tuple(copy.deepcopy(w) for w in weights) for _ in range(-(-self.ring_bytes // per_copy) - 1)]
        clock = time.thread_time if self.cpu_time else time.perf_counter
        times = []
        start = time.perf_counter()
        while len(times) < self.min_reps or (time.perf_counter() - start < self.budget_s
                                             and len(times) < self.max_reps):
            args = ring[len(times) % len(ring)]
            t0 = clock()
            fn(*args)
            times.append(clock() - t0)
        return STATS[self.stat](times)


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """The median of `repeats` results of fn (each a duration it measured itself)."""
    return statistics.median(fn() for _ in range(repeats))
