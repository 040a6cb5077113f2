"""Atomic saves: a checkpoint on disk is always the old one or the new one, never a mix.

Note [Atomic saves]
~~~~~~~~~~~~~~~~~~~
One file: Note [Atomic writes] in files/atomic_write.py (temporary, fsync, os.replace, fsync of the directory).
Every file torchqkit writes is first written under a hidden temporary name in its final directory
(``.<name>.<random>.tmp``), flushed and fsync'ed, then moved into place with ``os.replace`` (atomic on POSIX
and Windows within one file system), and the directory is fsync'ed. A save that fails part-way (disk full, a
tensor that can't be written, Ctrl-C) removes its temporaries and leaves the previous files untouched.

A sharded save is a set of files. Its shards get names no other save uses (``<stem>-<save id>-00001-of-0000N
.safetensors``, the save id also recorded in every shard's header and in the index), so writing them can't
overwrite a shard the current index points at. All shards are renamed into place first and the index last: until
the index is replaced, loaders see the old index and the old shards; after, the new ones. Only then are the
files of the previous checkpoint at that path removed (its shards, or a single file the new index replaces;
only names of that stem's shard pattern, never what an index merely lists). A crash between the index rename
and that clean-up leaves stale files next to a complete new checkpoint; the loader refuses a path that has
both a single file and an index (see save_load._resolve_checkpoint_path), it never guesses.
"""
from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from ..files.atomic_write import (check_destination, discard_temp, finish_temp, fsync_directory, remove_stale_temps,
                                  replace_temp, temp_file, unlink_quietly)

__all__ = ["CheckpointFiles", "INDEX_SUFFIX", "files_a_save_replaces", "new_save_id"]

INDEX_SUFFIX = ".index.json"


class CheckpointFiles:
    """The files of one save of a checkpoint at ``path``: staged under temporary names, then committed together.

    shard_paths(n): final names (``[path]`` for one file); stage(tmp, final): a finished temporary to move to
    ``final``; stage_index(data): the index, moved last; commit(); discard() on failure."""

    def __init__(self, path):
        self.path = check_destination(Path(path))
        self.save_id = new_save_id()
        # killed saves' temporaries of any file of this checkpoint (Note [Stale temporaries] in files/atomic_write.py)
        remove_stale_temps(self.path.parent, [self.path.name, self.index_path.name, _shard_pattern(self.path)])
        self._staged: list[tuple[Path, Path]] = []
        self._index: Path | None = None

    @property
    def index_path(self) -> Path:
        return self.path.with_name(self.path.name + INDEX_SUFFIX)

    def shard_paths(self, n: int) -> list[Path]:
        if n == 1:
            return [self.path]
        stem = _stem(self.path)
        return [self.path.with_name(f"{stem}-{self.save_id}-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]

    def stage(self, tmp: Path, final: Path) -> None:
        self._staged.append((Path(tmp), Path(final)))

    def stage_index(self, data: bytes) -> Path:
        f, tmp = temp_file(self.index_path)
        try:
            f.write(data)
            finish_temp(f, tmp)
        except BaseException:
            discard_temp(f, tmp)
            raise
        self._index = tmp
        return self.index_path

    def commit(self) -> None:
        """Move shards into place, then the index; then remove what is left of the previous checkpoint."""
        stale = _previous_files(self.path)
        moves = self._staged + ([(self._index, self.index_path)] if self._index is not None else [])
        self._staged, self._index = [], None
        done = []
        try:
            for tmp, final in moves:
                replace_temp(tmp, final)
                done.append(final)
        except BaseException:
            # Not all moved, so the index (moved last) is still the old one, and the shards moved so far carry
            # this save's id in their names: nothing refers to them. Remove them and the unmoved temporaries.
            for final in done:
                unlink_quietly(final)
            for tmp, _ in moves[len(done):]:
                unlink_quietly(tmp)
            raise
        fsync_directory(self.path.parent)
        new = {final for _, final in moves}
        for old in stale:
            if old not in new:
                unlink_quietly(old)

    def discard(self) -> None:
        for tmp, _ in self._staged:
            unlink_quietly(tmp)
        if self._index is not None:
            unlink_quietly(self._index)
        self._staged, self._index = [], None


def _stem(path: Path) -> str:
    return path.name.removesuffix(".safetensors")


def new_save_id() -> str:
    """8 hex digits, new for every save: written into every shard's header (Note [Atomic saves])."""
    return secrets.token_hex(4)


def _shard_pattern(path: Path) -> re.Pattern:
    """Shard names of the checkpoint at ``path``: ``<stem>-[<save id>-]00001-of-00003.safetensors``."""
    return re.compile(re.escape(_stem(path)) + r"-(?:[0-9a-f]{8}-)?\d{5}-of-\d{5}\.safetensors")


def files_a_save_replaces(path) -> list[Path]:
    """Every path a save at ``path`` may write or remove: the file, its index, and the shard names of its stem
    (existing ones; new shards get fresh names no other file has)."""
    path = Path(path)
    index = path.with_name(path.name + INDEX_SUFFIX)
    shards = [p for p in path.parent.iterdir() if _shard_pattern(path).fullmatch(p.name)] if path.parent.is_dir() else []
    return [path, index, *sorted(shards)]


def _previous_files(path: Path) -> list[Path]:
    """Files of the checkpoint saved at ``path`` before, in the order to remove them: the index first (so a
    reader never finds an index whose shards are gone), then its shards, or the single file. Only regular
    files, and only shard names of this stem's pattern: an index can't make a save delete anything else."""
    index = path.with_name(path.name + INDEX_SUFFIX)
    pattern = _shard_pattern(path)
    out = [p for p in (index, path) if p.is_file() and not p.is_symlink()]
    out += sorted(p for p in path.parent.iterdir()
                  if pattern.fullmatch(p.name) and p.is_file() and not p.is_symlink())
    return out
