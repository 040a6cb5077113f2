"""Read and rewrite the JSON header of a safetensors file (test helper: makes files that lie)."""
from __future__ import annotations

import json
from pathlib import Path


def read_header(path) -> tuple[dict, bytes]:
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    Path(path).write_bytes(len(text).to_bytes(8, "little") + text + data)


def edit_torchqkit(path, fn) -> None:
    """Apply ``fn`` to the decoded torchqkit header (in place) and write the file back."""
    header, data = read_header(path)
    tq = json.loads(header["__metadata__"]["torchqkit"])
    fn(tq)
    header["__metadata__"]["torchqkit"] = json.dumps(tq)
    write_header(path, header, data)


def edit_tensors(path, fn) -> None:
    """Apply ``fn`` to the safetensors header (tensor entries and __metadata__) and write the file back."""
    header, data = read_header(path)
    fn(header)
    write_header(path, header, data)
