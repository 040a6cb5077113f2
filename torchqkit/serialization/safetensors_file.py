"""A safetensors reader and writer that hold one tensor at a time and never unpickle.

The file format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N,
N bytes of JSON ``{"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}``,
then the data; offsets are relative to the data start and tile it without holes. Files written here load
with ``safetensors.torch.load_file`` and any other safetensors reader.

Why not ``safetensors.safe_open``: reading tensors with ``readinto`` into fresh torch allocations (1) keeps
peak memory at the tensors actually read (mmap'd pages would be counted again), (2) gives aligned tensors
(see PLATFORM.md, "Serialization"), and (3) lets every problem name the tensor: a truncated file, offsets
that don't match the shape, a header that isn't JSON.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = ["CheckpointError", "SafetensorsReader", "SafetensorsWriter", "DTYPES"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself applies
_ALIGN = 8


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, inconsistent, or doesn't fit the model; the message names the
    file, the tensor and the problem."""


class SafetensorsReader:
    """Validated header of one safetensors file; ``read(name)`` loads one tensor."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"{self.path}: can't open ({e.strerror})") from None
        size = os.fstat(self._file.fileno()).st_size
        raw = self._file.read(8)
        if len(raw) < 8:
            self.close()
            raise CheckpointError(f"{self.path}: truncated file ({size} bytes): not even the 8-byte header length")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER_BYTES or n > size - 8:
            self.close()
            raise CheckpointError(f"{self.path}: header length {n} exceeds the file ({size} bytes) or the "
                                  f"{MAX_HEADER_BYTES}-byte limit: truncated or not a safetensors file")
        text = self._file.read(n)
        self._data_start = 8 + n
        self._data_size = size - self._data_start
        try:
            header = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self.close()
            raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            self.close()
            raise CheckpointError(f"{self.path}: header must be a JSON object, got {type(header).__name__}")
        try:
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

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_metadata(meta) -> dict[str, str]:
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("__metadata__ must map strings to strings")
    return meta


def _check_entry(name: str, e) -> dict:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"tensor {name!r}: header entry must have exactly dtype, shape, data_offsets; "
                              f"got {e!r:.200}")
    if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:
        raise CheckpointError(f"tensor {name!r}: unknown dtype {e['dtype']!r}; known: {sorted(DTYPES)}")
    shape, offsets = e["shape"], e["data_offsets"]
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise CheckpointError(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r:.200}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]):
        raise CheckpointError(f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                              f"got {offsets!r:.200}")
    need = math.prod(shape) * DTYPES[e["dtype"]].itemsize
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(f"tensor {name!r}: header says shape {shape} {e['dtype']} ({need} bytes) but its data "
                              f"spans {offsets[1] - offsets[0]} bytes")
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
    """Writes one safetensors file a tensor at a time: data is appended to a temporary file next to ``path``
    as tensors come, the header (which needs every offset) is written at ``close``, then the data is copied
    behind it in chunks. Memory: one tensor (plus a copy if it wasn't contiguous)."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".data", dir=self.path.parent)
        self._data = os.fdopen(fd, "wb")
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

    def close(self, metadata: dict[str, str], path=None) -> None:
        """Write the file (at ``path`` if given: shard names are known only once all shards are)."""
        self.path = Path(path) if path is not None else self.path
        self._data.close()
        header = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % _ALIGN)  # data starts 8-byte aligned, as safetensors writes it
        try:
            with open(self.path, "wb") as out, open(self._tmp, "rb") as data:
                out.write(len(header).to_bytes(8, "little"))
                out.write(header)
                shutil.copyfileobj(data, out, 1 << 20)  # small chunks: the copy adds ~1 MB to peak memory
        finally:
            os.unlink(self._tmp)

    def abort(self) -> None:
        self._data.close()
        os.unlink(self._tmp)
