"""Atomic file writes: a file torchqkit writes is always the old one or the new one, never a mix.

Note [Atomic writes]
~~~~~~~~~~~~~~~~~~~~
Every file torchqkit writes is first written under a hidden temporary name in its final directory
(``.<name>.<random>.tmp``), flushed and fsync'ed, then moved into place with ``os.replace`` (atomic on POSIX
and Windows within one file system), and the directory is fsync'ed. A save that fails part-way (disk full, a
tensor that can't be written, Ctrl-C) removes its temporaries and leaves the previous files untouched; the
temporary is removed even when closing it fails again (``discard_temp``: the buffered bytes that failed to
write fail again on close).
(serialization/atomic.py extends this to sharded checkpoints: Note [Atomic saves] there.)

Note [Stale temporaries]
~~~~~~~~~~~~~~~~~~~~~~~~
A save that is killed (SIGKILL, the OOM killer, a power cut) leaves its temporaries behind. The next save of the
same destination removes them, but must never remove a temporary of a save that is still running in another
process. So every temporary is locked (``flock``, exclusive) by the process writing it from its creation until it
is renamed or removed (a duplicate descriptor keeps the lock after the file object is closed), and
``remove_stale_temps`` removes only hidden ``.<name>.<random>.tmp`` files of the destination's names that (1) no
process holds locked, and (2) were last modified over STALE_AFTER_SECONDS ago: the lock can only be taken right
after the file is created, so a brand-new temporary is never mistaken for a dead one. The kernel drops a dead
process's locks, so a killed save's temporaries are removed by the next save a minute later or more. Without
flock (Windows) nothing is removed.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so temporaries are never judged stale
    fcntl = None

__all__ = ["atomic_write_bytes", "temp_file", "finish_temp", "fsync_directory", "unlink_quietly", "check_destination",
           "replace_temp", "discard_temp", "remove_stale_temps", "STALE_AFTER_SECONDS"]

STALE_AFTER_SECONDS = 60.0
# mkstemp's names: "." + prefix + 8 random characters + suffix
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp")
_LOCKS: dict[str, int] = {}  # temporary's path -> a duplicate descriptor holding its lock (Note [Stale temporaries])


def temp_file(final: Path):
    """(open binary file, its path): a fresh hidden temporary next to ``final``, created exclusively and locked
    until ``replace_temp`` / ``unlink_quietly`` / ``discard_temp`` (Note [Stale temporaries])."""
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _LOCKS[tmp] = os.dup(fd)
        except OSError:  # a file system without flock: the temporary is still ours, just never judged stale
            pass
    return os.fdopen(fd, "wb"), Path(tmp)


def _release(path) -> None:
    fd = _LOCKS.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def replace_temp(tmp: Path, final: Path) -> None:
    """Move a finished temporary into place and drop its lock."""
    os.replace(tmp, final)
    _release(tmp)


def discard_temp(f, tmp: Path) -> None:
    """The abort path: close ``f`` (its failure ignored: the bytes that failed to write fail again on close) and
    remove the temporary whatever happened."""
    try:
        with contextlib.suppress(OSError):
            f.close()
    finally:
        unlink_quietly(tmp)


def remove_stale_temps(directory: Path, names) -> list[Path]:
    """Remove the temporaries of killed saves of ``names`` (final file names, or compiled patterns over them) in
    ``directory``; returns what was removed. See Note [Stale temporaries] for why a live save's are never taken."""
    if fcntl is None:
        return []
    wanted = [re.compile(re.escape(n)) if isinstance(n, str) else n for n in names]
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    now = time.time()
    for entry in entries:
        m = _TEMP_NAME.fullmatch(entry.name)
        if m is None or not any(w.fullmatch(m.group("name")) for w in wanted) or entry.path in _LOCKS:
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or now - entry.stat(follow_symlinks=False).st_mtime < STALE_AFTER_SECONDS:
                continue
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live save: BlockingIOError, leave it
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def finish_temp(f, tmp: Path) -> Path:
    """Flush, fsync and close a temporary written through ``f``; the data is on disk before any rename."""
    f.flush()
    os.fsync(f.fileno())
    f.close()
    return tmp


def fsync_directory(directory: Path) -> None:
    """Persist renames in ``directory`` (POSIX: a rename is durable once its directory is fsync'ed)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove ``path`` if it exists (and drop its lock if it is one of our temporaries)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        _release(path)


def check_destination(path: Path) -> Path:
    """Create the parent directory; refuse a destination that is a directory (os.replace would fail only at the
    very end, after all the writing)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(21, "is a directory, not a file name to save to", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see Note [Atomic writes])."""
    path = check_destination(Path(path))
    remove_stale_temps(path.parent, [path.name])
    f, tmp = temp_file(path)
    try:
        f.write(data)
        finish_temp(f, tmp)
        replace_temp(tmp, path)
    except BaseException:
        discard_temp(f, tmp)
        raise
    fsync_directory(path.parent)
    return path
