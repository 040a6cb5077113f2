"""A one-line progress bar on stderr (no tqdm dependency): `label: done/total unit (pct) elapsed [extra]`, shared by
quantize_, from_gguf, quantize_checkpoint and the evaluation loops (any layer may use it)."""
from __future__ import annotations

import sys
import time

__all__ = ["ProgressLine", "progress_enabled"]


class ProgressLine:
    """Rewrites one stderr line with `\\r` on every update and ends it with a newline on close().

    Disabled (enabled=False) it prints nothing, so callers need no `if` around it. Updates closer than
    `min_interval` seconds are dropped, except the last one (done == total), so a fast loop does not
    spend its time writing to the terminal.
    """

    def __init__(self, label: str, total: int, unit: str = "tokens", *, enabled: bool = True,
                 stream=None, min_interval: float = 0.1):
        self.label, self.total, self.unit = label, total, unit
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.min_interval = min_interval
        self.start = time.perf_counter()
        self._last_write = float("-inf")
        self._width = 0

    def update(self, done: int, extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < self.total and now - self._last_write < self.min_interval:
            return
        self._last_write = now
        pct = 100.0 * done / self.total if self.total else 100.0
        line = f"{self.label}: {done}/{self.total} {self.unit} ({pct:.0f}%) {now - self.start:.1f}s"
        if extra:
            line += f" {extra}"
        # Pad with spaces so a shorter line fully covers the previous one.
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = max(self._width, len(line))

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()


def progress_enabled(progress: bool | None, stream=None) -> bool:
    """``progress`` as given, or when None (the default of the library calls that take it), whether ``stream``
    (stderr) is a terminal: a bar in a log file or a captured stream is noise."""
    if progress is not None:
        return bool(progress)
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
