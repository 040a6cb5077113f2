"""One progress line on stderr (no tqdm dependency), shared by every long library call: quantize_, calibration,
load_quantized / from_pretrained, from_gguf, quantize_checkpoint, the demo and the evaluation loops.

    label [#######-------------] done/total unit (pct) elapsed extra

Any layer may use it.
"""
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
                 stream=None, min_interval: float = 0.1, bar_width: int = 20):
        self.label, self.total, self.unit = label, total, unit
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.min_interval, self.bar_width = min_interval, bar_width
        self.start = time.perf_counter()
        self._last_write = float("-inf")
        self._width = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, done: int, extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < self.total and now - self._last_write < self.min_interval:
            return
        self._last_write = now
        fraction = min(done / self.total, 1.0) if self.total else 1.0
        filled = int(self.bar_width * fraction)
        bar = "#" * filled + "-" * (self.bar_width - filled)
        line = (f"{self.label} [{bar}] {done}/{self.total} {self.unit} ({100 * fraction:.0f}%) "
                f"{now - self.start:.1f}s")
        if extra:
            line += f" {extra}"
        # Pad with spaces so a shorter line fully covers the previous one.
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = max(self._width, len(line))

    def close(self, summary: str = "") -> None:
        """End the line; ``summary`` (e.g. what was done in how long) goes on a line of its own."""
        if not self.enabled:
            return
        if self._width:
            self.stream.write("\n")
        if summary:
            self.stream.write(summary + "\n")
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
