"""Opening a user's file for reading, one rule for every file torchqkit reads (checkpoints, shards, indexes,
config.json, GGUF files): a regular file, named directly.

Symbolic links are refused, not followed: a link can make a loader read, and an error message describe, a file
nobody meant to hand over. The check is repeated on the open descriptor (O_NOFOLLOW, fstat), so a link swapped in
after the check is refused too. FIFOs and devices are refused (opening one can block).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["open_regular_file"]


def open_regular_file(path, error: type[Exception] = ValueError, what: str = "file"):
    """``path`` opened for binary reading; any problem raises ``error`` naming the path. ``what`` names the kind of
    file in the symlink message ("checkpoint file", "GGUF file")."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise error(f"{path}: can't open ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path}: is a symbolic link; torchqkit never follows links to a {what}. Pass the file itself "
                    f"(e.g. os.path.realpath(path), if you trust where it points)")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise error(f"{path}: can't open ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{path}: not a regular file")
    return os.fdopen(fd, "rb")
