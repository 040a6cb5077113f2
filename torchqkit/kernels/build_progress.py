"""Progress of the C++ extension's first build, shown while pip runs it (setup.py loads this file by path).

pip captures a build's output and shows it only with -v or on failure, so a first install would sit silent for
minutes. While the compiler runs, a thread counts the object files that have appeared and rewrites one line on
the terminal pip runs in (/dev/tty, which pip doesn't capture); without a terminal (CI, a log) it writes to stderr,
a line every 30 s, which ends up in the build log.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time

__all__ = ["BuildProgress", "parallel_jobs"]


def parallel_jobs() -> tuple[int, str]:
    """How many files torch's extension builder compiles at once, and why (what the progress line states)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if os.environ.get("MAX_JOBS", "").isdigit():
        return int(os.environ["MAX_JOBS"]), "MAX_JOBS"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the PyPI package puts the binary next to it)
        except ImportError:
            return 1, "ninja not found: one file at a time; `pip install ninja` compiles them in parallel"
    return cores, f"{cores} cores"


class BuildProgress:
    """``with BuildProgress(what, objects):`` counts ``objects`` (the .o paths) as they appear."""

    def __init__(self, what: str, objects: list[str], interval: float = 2.0):
        self.what, self.objects, self.interval = what, objects, interval
        self.jobs, self.why = parallel_jobs()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tty = None

    def __enter__(self):
        self.start = time.monotonic()
        try:
            self._tty = open("/dev/tty", "w")  # noqa: SIM115  (closed in __exit__)
        except OSError:
            self._tty = None  # no controlling terminal
        self._write(f"torchqkit: compiling the C++ CPU kernels ({len(self.objects)} files, {self.why}; "
                    f"about 3 minutes on 2 cores)", final=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        state = "failed" if exc[0] is not None else "done"
        self._write(f"torchqkit: compiling the C++ CPU kernels: {state} in {time.monotonic() - self.start:.0f} s",
                    final=True)
        if self._tty is not None:
            self._tty.close()
        return False

    def _done(self) -> int:
        return sum(os.path.isfile(o) and os.path.getmtime(o) >= self.start - 1 for o in self.objects)

    def _run(self) -> None:
        last_log = time.monotonic()
        while not self._stop.wait(self.interval):
            line = (f"torchqkit: compiling the C++ CPU kernels: {self._done()}/{len(self.objects)} files, "
                    f"{time.monotonic() - self.start:.0f} s")
            if self._tty is not None:
                self._write(line)
            elif time.monotonic() - last_log >= 30:
                self._write(line, final=True)
                last_log = time.monotonic()

    def _write(self, line: str, final: bool = False) -> None:
        if self._tty is not None:
            self._tty.write("\r" + line.ljust(100) + ("\n" if final else ""))
            self._tty.flush()
        else:
            print(line, file=sys.stderr, flush=True)
