"""Resident memory of this process (Linux /proc): the current figure, the kernel's peak (VmHWM, resettable through
/proc/self/clear_refs) and a sampled peak of any reading, for what a block of code needed at most."""
from __future__ import annotations

import os
import threading


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_anon() -> int:
    """Memory the process allocated, without the file pages a memory-mapped read leaves resident (and reclaimable)."""
    return _status("RssAnon")


def peak_rss() -> int:
    """VmHWM: the peak RSS since the last reset_peak_rss (file pages of memory-mapped reads included)."""
    return _status("VmHWM")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SampledPeak:
    """The peak of `read()` (default rss) sampled every `every_s` by a thread while the block runs."""

    def __init__(self, read=rss, every_s: float = 0.002):
        self.read, self.every_s = read, every_s

    def __enter__(self):
        self.start = self.peak = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.read())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())
