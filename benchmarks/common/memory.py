"""Memory the caches can't hold: the ring of weight copies decode rows read from, and the read-bandwidth probe a
memory-bound kernel's GB/s is compared with (measured by the same run: on a shared host it drifts by tens of %)."""
from __future__ import annotations

import statistics
import time

import torch

from .machine import l3_bytes

# Weights read in turn from a ring of copies this large, and the probe's buffer, come from memory.
RING_BYTES = max(96 * 2**20, 3 * l3_bytes())
FLUSH_BYTES = max(128 * 2**20, l3_bytes())
_flush_bufs: dict[int, torch.Tensor] = {}


def flush_caches(nbytes: int = FLUSH_BYTES) -> None:
    """Writes a buffer of `nbytes` (by default larger than the L3) over the caches; allocated on first use."""
    if nbytes not in _flush_bufs:
        _flush_bufs[nbytes] = torch.empty(nbytes // 4)
    _flush_bufs[nbytes].add_(1.0)


# --quick runs check the code, not the figures: a ring and a probe this small keep them to seconds.
QUICK_BYTES = 8 * 2**20
QUICK_RING = 2**20  # a few copies of a --quick weight: the ring's code runs, without minutes of copying


def read_bandwidth(reps: int = 7, stat=statistics.median, nbytes: int = RING_BYTES) -> float:
    """GB/s of a parallel read-only pass (a sum) over a fresh buffer of `nbytes` after a flush, `stat` of `reps`.
    A --quick probe (nbytes < RING_BYTES) flushes as many bytes only: its figure checks the code, not the memory."""
    buf = torch.ones(nbytes // 4)
    times = []
    for _ in range(reps):
        flush_caches(FLUSH_BYTES if nbytes >= RING_BYTES else nbytes)
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / stat(times) / 1e9
