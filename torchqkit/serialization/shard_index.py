"""Where a checkpoint's files are: resolving a path to a file or a shard index, and reading / writing the
index (Hugging Face's layout, see Note [torchqkit safetensors format] in save_load.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..files.strict_json import parse_json
from .atomic import INDEX_SUFFIX, CheckpointFiles
from .safetensors_file import CheckpointError, open_checkpoint_file

__all__ = ["resolve_checkpoint_path", "read_index", "write_index", "check_save_id"]


def resolve_checkpoint_path(path) -> Path:
    """The file to open for ``path``: a .safetensors file, its index (given, or found next to the missing file
    name), or a directory's model.safetensors / its index. Both a file and its index: refused, see
    Note [Atomic saves] (atomic.py): one of them is left over from an earlier save, and guessing could load it."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    index = path.with_name(path.name + INDEX_SUFFIX)
    if os.path.lexists(path) and os.path.lexists(index) and not path.name.endswith(INDEX_SUFFIX):
        raise CheckpointError(f"{path}: both this file and {index.name} exist: two checkpoints under one name, one "
                              f"of them left over from an earlier save (interrupted, or by another tool). Remove the "
                              f"stale one; to load the sharded one as it is, pass {index.name} itself")
    if not os.path.lexists(path) and os.path.lexists(index):
        path = index
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: no such checkpoint (a .safetensors file, its {INDEX_SUFFIX}, or a directory "
                              f"holding model.safetensors)")
    return path


MAX_INDEX_BYTES = 100 * 1024 * 1024  # as for a safetensors header


def read_index(path: Path):
    """(shard file names, stored tensor name -> shard file name, save id or None) of a shard index."""
    with open_checkpoint_file(path) as f:
        raw = f.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise CheckpointError(f"{path}: index larger than {MAX_INDEX_BYTES} bytes")
    index = parse_json(raw, f"{path}: index", CheckpointError)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{path}: index needs a weight_map of tensor name -> shard file name")
    files = sorted(set(wm.values()))
    for f in files:
        if Path(f).name != f or not f.endswith(".safetensors"):
            raise CheckpointError(f"{path}: the index names a shard that is not a .safetensors file in the index's "
                                  f"directory; each shard must be a .safetensors file name in the index's directory")
    return files, wm, _index_save_id(path, index)


_NO_SAVE_ID = object()


def _index_save_id(path: Path, index: dict):
    """The save id an index records: a string, None (a torchqkit index from before save ids), or _NO_SAVE_ID when
    its torchqkit metadata is missing or unreadable. That metadata is informational (a copy of the shards'
    header); what is loaded comes from the weight map and the shards, all checked. Without a recorded id, the
    shards' file names, which carry it, are what ties them to the index."""
    meta = index.get("metadata")
    header = meta.get("torchqkit") if isinstance(meta, dict) else None
    if not isinstance(header, str):
        return _NO_SAVE_ID
    try:
        header = parse_json(header, f"{path}: index metadata 'torchqkit'", CheckpointError)
    except CheckpointError:
        return _NO_SAVE_ID
    return header.get("save_id") if isinstance(header, dict) else _NO_SAVE_ID


def check_save_id(path: Path, save_id, shard: str, shard_save_id) -> None:
    """The shards an index names were written by the save that wrote the index (Note [Atomic saves])."""
    if save_id is not _NO_SAVE_ID and shard_save_id != save_id:
        raise CheckpointError(f"{path}: shard {shard} was written by another save than this index "
                              f"(save ids differ): the index and its shards don't belong together")


def write_index(out: CheckpointFiles, header: dict, weight_map: dict[str, str], total_size: int) -> Path:
    """Stage ``<name>.index.json`` in ``out`` (moved into place after every shard)."""
    index = {"metadata": {"torchqkit": json.dumps({**header, "weights": {}}), "total_size": total_size},
             "weight_map": weight_map}
    return out.stage_index((json.dumps(index, indent=1) + "\n").encode())
