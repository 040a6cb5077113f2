"""Atomic file writes: a file torchqkit writes is always the old one or the new one, never a mix.

Note [Atomic writes]
~~~~~~~~~~~~~~~~~~~~
Every file torchqkit writes is first written under a hidden temporary name in its final directory
(``.<name>.<random>.tmp``), flushed and fsync'ed, then moved into place with ``os.replace`` (atomic on POSIX
and Windows within one file system), and the directory is fsync'ed. A save that fails part-way (disk full, a
tensor that can't be written, Ctrl-C) removes its temporaries and leaves the previous files untouched.
(serialization/atomic.py extends this to sharded checkpoints: Note [Atomic saves] there.)
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "temp_file", "finish_temp", "fsync_directory", "unlink_quietly", "check_destination"]


def temp_file(final: Path):
    """(open binary file, its path): a fresh hidden temporary next to ``final``, created exclusively."""
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    return os.fdopen(fd, "wb"), Path(tmp)


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
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
    f, tmp = temp_file(path)
    try:
        f.write(data)
        finish_temp(f, tmp)
        os.replace(tmp, path)
    except BaseException:
        f.close()
        unlink_quietly(tmp)
        raise
    fsync_directory(path.parent)
    return path
