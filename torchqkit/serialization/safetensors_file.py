"""A safetensors reader and writer that hold one tensor at a time and never unpickle.

The file format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N,
N bytes of JSON ``{"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}``,
then the data; offsets are relative to the data start and tile it without holes. Files written here load
with ``safetensors.torch.load_file`` and any other safetensors reader.

Why not ``safetensors.safe_open``: reading tensors with ``readinto`` into fresh torch allocations (1) keeps
peak memory at the tensors actually read (mmap'd pages would be counted again), (2) gives aligned tensors
(see docs/platform.md, "Serialization"), and (3) lets every problem name the tensor: a truncated file, offsets
that don't match the shape, a header that isn't JSON.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from ..files.open_checked import open_regular_file
from ..files.atomic_write import (check_destination, discard_temp, finish_temp, fsync_directory, replace_temp,
                                  temp_file, unlink_quietly)
from ..files.strict_json import parse_json

__all__ = ["CheckpointError", "SafetensorsReader", "SafetensorsWriter", "DTYPES", "open_checkpoint_file"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    # AMD's float8 (Note [float8 fnuz] in core/qdtype.py), under the names the safetensors library gives them
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself applies
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}
_ALIGN = 8


class CheckpointError(ValueError):
    """A checkpoint is unreadable, inconsistent, or doesn't fit the model.

    Raised by ``load_quantized``, ``from_pretrained`` (and transformers' ``from_pretrained`` through the torchqkit
    quantizer), ``quantize_checkpoint`` (e.g. for an already quantized source) and the safetensors reader; the
    message names the file, the tensor and the problem. Checks run before the model is touched, so a model left
    by a failed load is unchanged. A ``ValueError``.

    Example:
        ```python
        import torchqkit as qk
        try:
            qk.load_quantized(model, "model-int4.safetensors")
        except qk.CheckpointError as e:
            print("not loaded:", e)
        ```
    """


class SafetensorsReader:
    """Validated header of one safetensors file; ``read(name)`` loads one tensor."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = open_checkpoint_file(self.path)
        size = os.fstat(self._file.fileno()).st_size
        raw = self._file.read(8)
        if len(raw) < 8:
            self.close()
            raise CheckpointError(f"{self.path}: truncated file ({size} bytes): not even the 8-byte header length")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER_BYTES or n > size - 8:
            self.close()  # the length itself is not quoted: it is the file's first bytes, whatever the file is
            raise CheckpointError(f"{self.path}: the header length in the first 8 bytes exceeds the file ({size} bytes) "
                                  f"or the {MAX_HEADER_BYTES}-byte limit: truncated or not a safetensors file")
        text = self._file.read(n)
        self._data_start = 8 + n
        self._data_size = size - self._data_start
        try:
            header = parse_json(text, "header", CheckpointError)
            if not isinstance(header, dict):
                raise CheckpointError(f"header must be a JSON object, got a JSON {type(header).__name__}")
            self.metadata = _check_metadata(header.pop("__metadata__", None) or {})
            self.entries = {name: _check_entry(name, e) for name, e in header.items()}
            _check_offsets(self.entries, self._data_size)
        except CheckpointError as e:
            self.close()
            raise CheckpointError(f"{self.path}: {e}") from None

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        b, e = self.entries[name]["data_offsets"]
        return e - b

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        buf = torch.empty(end - begin, dtype=torch.uint8, device="cpu")  # also under a `with torch.device("meta")`
        self._file.seek(self._data_start + begin)
        got = self._file.readinto(memoryview(buf.numpy())) if end > begin else 0
        if got != end - begin:
            raise CheckpointError(f"{self.path}: tensor {name!r}: truncated file, read {got} of {end - begin} bytes")
        return buf.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def read_narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """``read(name).narrow(dim, start, length)``, reading only those bytes: one contiguous range along dim 0,
        one range per index of the dims before ``dim`` otherwise (a tensor-parallel rank's shard)."""
        entry = self.entries[name]
        shape, dtype = list(entry["shape"]), DTYPES[entry["dtype"]]
        if not (0 <= dim < len(shape) and 0 <= start and start + length <= shape[dim]):
            raise ValueError(f"{self.path}: tensor {name!r} {shape}: no range [{start}, {start + length}) along dim {dim}")
        item = dtype.itemsize
        inner = math.prod(shape[dim + 1:]) * item
        outer = math.prod(shape[:dim])
        seg, row = length * inner, shape[dim] * inner
        buf = torch.empty(outer * seg, dtype=torch.uint8, device="cpu")
        view = memoryview(buf.numpy())
        first = self._data_start + entry["data_offsets"][0] + start * inner
        fd = self._file.fileno()
        for o in range(outer if seg else 0):
            # Positioned reads of exactly the shard's bytes (a buffered read would pull whole pages around each
            # short row segment of a K shard).
            got = os.preadv(fd, [view[o * seg:(o + 1) * seg]], first + o * row)
            if got != seg:
                raise CheckpointError(f"{self.path}: tensor {name!r}: truncated file, read {got} of {seg} bytes")
        return buf.view(dtype).reshape(*shape[:dim], length, *shape[dim + 1:])

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint_file(path: Path):
    """Open a checkpoint file (safetensors file, shard or index) for reading: a regular file, named directly (the
    rule for every file torchqkit reads: files/open_checked.py)."""
    return open_regular_file(path, CheckpointError, "checkpoint file")


# Header problems never quote header values: the bytes may not come from a safetensors file at all. Tensor
# names are quoted (a message must say which tensor), truncated.
def _check_metadata(meta) -> dict[str, str]:
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("__metadata__ must map strings to strings")
    return meta


def _check_entry(name: str, e) -> dict:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        got = (f"fields {sorted(_ENTRY_FIELDS & set(e))} and {len(set(e) - _ENTRY_FIELDS)} other(s)"
               if isinstance(e, dict) else f"a JSON {type(e).__name__}")
        raise CheckpointError(f"tensor {name!r:.200}: header entry must have exactly dtype, shape, data_offsets; "
                              f"got {got}")
    if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:
        raise CheckpointError(f"tensor {name!r:.200}: unknown dtype; known: {sorted(DTYPES)}")
    shape, offsets = e["shape"], e["data_offsets"]
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise CheckpointError(f"tensor {name!r:.200}: shape must be a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]):
        raise CheckpointError(f"tensor {name!r:.200}: data_offsets must be [begin, end] with 0 <= begin <= end")
    need = math.prod(shape) * DTYPES[e["dtype"]].itemsize
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(f"tensor {name!r:.200}: header says shape {shape} {e['dtype']} ({need} bytes) but its "
                              f"data spans {offsets[1] - offsets[0]} bytes")
    return e


def _check_offsets(entries: dict, data_size: int) -> None:
    pos = 0
    for name, e in sorted(entries.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = e["data_offsets"]
        if end > data_size:
            raise CheckpointError(f"tensor {name!r}: truncated file: its data ends at byte {end} of the data section, "
                                  f"which holds {data_size} bytes")
        if begin != pos:
            raise CheckpointError(f"tensor {name!r}: data starts at {begin}, expected {pos} (overlapping or holes)")
        pos = end
    if pos != data_size:
        raise CheckpointError(f"{data_size - pos} bytes of data after the last tensor: the header doesn't describe "
                              f"the file")


class SafetensorsWriter:
    """Writes one safetensors file a tensor at a time: data is appended to a hidden temporary file next to
    ``path`` as tensors come; ``finish`` writes the header (which needs every offset) and copies the data behind
    it in chunks into a second temporary, fsync'ed, which the caller moves into place (see Note [Atomic saves],
    atomic.py); ``close`` does both for a lone file. Memory: one tensor (plus a copy if it wasn't contiguous).
    Nothing is ever written at ``path`` itself until the final rename."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._data, self._tmp = temp_file(self.path)
        self._staged: Path | None = None
        self.entries: dict[str, dict] = {}
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.entries or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} written twice (or reserved)")
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors code")
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._data.write(memoryview(flat.numpy()))
        n = flat.numel()
        self.entries[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self.nbytes, self.nbytes + n]}
        self.nbytes += n

    def finish(self, metadata: dict[str, str], final=None) -> Path:
        """Write the complete file under a temporary name next to ``final`` (default ``path``), fsync'ed, and
        return that name; the caller renames it (shard names are known only once all shards are)."""
        final = Path(final) if final is not None else self.path
        self._data.close()
        header = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % _ALIGN)  # data starts 8-byte aligned, as safetensors writes it
        out, self._staged = temp_file(final)
        try:
            with open(self._tmp, "rb") as data:
                out.write(len(header).to_bytes(8, "little"))
                out.write(header)
                shutil.copyfileobj(data, out, 1 << 20)  # small chunks: the copy adds ~1 MB to peak memory
            finish_temp(out, self._staged)
        except BaseException:
            discard_temp(out, self._staged)
            self.abort()
            raise
        unlink_quietly(self._tmp)
        return self._staged

    def close(self, metadata: dict[str, str], path=None) -> None:
        """Finish and move the file into place at ``path`` (default: the constructor's) atomically."""
        self.path = Path(path) if path is not None else self.path
        check_destination(self.path)
        staged = self.finish(metadata)
        try:
            replace_temp(staged, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_directory(self.path.parent)

    def abort(self) -> None:
        """Remove every temporary this writer made, even if closing the data file fails again (its buffered bytes
        are what failed to write); the destination is untouched."""
        discard_temp(self._data, self._tmp)
        if self._staged is not None:
            unlink_quietly(self._staged)
