"""quantize_checkpoint: float safetensors checkpoint -> torchqkit checkpoint, one tensor at a time.

Which tensors are Linear weights (see Note [Linear weights in a checkpoint]):
  - with ``model=`` (any nn.Module, e.g. built on the meta device): exactly the weights of its nn.Linear
    modules, as quantize_ would pick them;
  - without: every 2-d floating ``<module>.weight`` whose module path has no segment naming an embedding
    (a segment containing "embed", or GPT-2's "wte" / "wpe"): embeddings are 2-d too, and nothing else in
    the file tells them apart. Pass ``model=`` or a ModuleConfigs with None for anything this guesses wrong.
The config (QuantConfig or ModuleConfigs) then selects among those Linear weights by module name, as in
quantize_; everything else is copied unchanged.

Memory: the source is read with ``readinto`` one tensor at a time, the packed result is appended to a
temporary data file at once, and headers are written at the end (SafetensorsWriter); at any moment the
process holds one float tensor, its quantization temporaries and its packed form.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ..api.configs.base import handler_for
from ..api.quantize import QuantizationError, _as_module_configs
from ..api.quantize_weight import UnsupportedWeight
from ..api.report import LayerReport, QuantizationReport
from .entries import INNER_SEP, encode_entry
from .safetensors_file import CheckpointError, SafetensorsReader, SafetensorsWriter
from .save_load import INDEX_SUFFIX, file_header, file_metadata, read_index, shard_paths, write_index

__all__ = ["quantize_checkpoint"]

_EMBEDDING_SEGMENT = re.compile(r"(^|\.)([^.]*embed[^.]*|wte|wpe)(\.|$)", re.IGNORECASE)


def quantize_checkpoint(src, dst, config, *, model: nn.Module | None = None, max_shard_bytes: int | None = None,
                        strict: bool = False, progress: bool = True) -> QuantizationReport:
    """Quantize the Linear weights of the float safetensors checkpoint ``src`` (file, index or directory) that
    ``config`` selects and write a torchqkit checkpoint to ``dst`` (loadable with load_quantized).

    model: optional skeleton naming the Linear modules; otherwise they are guessed from names and shapes.
    max_shard_bytes: shard the output past this size (``<dst>.index.json``).
    strict: raise QuantizationError (writing nothing) if a selected weight can't be quantized; otherwise it
    is copied in float and reported. progress: a progress line on stderr.
    Returns a QuantizationReport with one entry per Linear weight."""
    configs = _as_module_configs(config)
    for c in configs.configs.values():
        if c is not None:
            handler_for(c)
    readers = [SafetensorsReader(f) for f in _source_files(Path(src))]
    dst = Path(dst)
    linear = None if model is None else {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    out = _ShardedOutput(dst, max_shard_bytes)
    try:
        names = [(r, n) for r in readers for n in r.names()]
        bar = _Progress(sum(r.nbytes(n) for r, n in names), len(names), enabled=progress)
        entries = []
        for reader, name in names:
            if INNER_SEP in name:
                raise CheckpointError(f"{reader.path}: tensor {name!r}: ':' names are torchqkit's packed tensors; "
                                      f"this checkpoint is already quantized")
            entries.extend(_convert_one(reader, name, configs, linear, out, strict))
            bar.step(reader.nbytes(name), name)
        bar.done()
        entries.extend(LayerReport(k, "skipped", "-", "ModuleConfigs names a module the checkpoint does not have", 0, 0)
                       for k in configs.exact_keys() if not any(e.fqn == k for e in entries))
        out.close(file_header(config, {}))
    except BaseException:
        out.abort()
        raise
    finally:
        for r in readers:
            r.close()
    return QuantizationReport(entries)


def _convert_one(reader: SafetensorsReader, name: str, configs, linear, out: "_ShardedOutput", strict: bool):
    tensor = reader.read(name)
    fqn = name.removesuffix(".weight")
    if not _is_linear_weight(name, tensor, linear):
        out.add(name, [(name, tensor)], None)
        return []
    nbytes = tensor.numel() * tensor.element_size()
    key, config = configs.lookup(fqn)
    if config is None:
        reason = ("no config matched (no exact name, pattern or _default)" if key is None
                  else f"ModuleConfigs[{key!r}] is None")
        out.add(name, [(name, tensor)], None)
        return [LayerReport(fqn, "kept", "-", reason, nbytes, nbytes)]
    try:
        w = handler_for(config)(config, tensor, name)
    except (UnsupportedWeight, ValueError) as e:
        if strict:
            raise QuantizationError(f"quantize_checkpoint(strict=True): {fqn}: {e}") from None
        out.add(name, [(name, tensor)], None)
        return [LayerReport(fqn, "skipped", config.describe(), str(e), nbytes, nbytes)]
    del tensor
    inner = [(f"{name}{INNER_SEP}{n}", t) for n, t in w.inner_tensors().items() if t is not None]
    out.add(name, inner, encode_entry(w))
    return [LayerReport(fqn, "quantized", config.describe(), "", nbytes, w.packed_nbytes())]


# Note [Linear weights in a checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A safetensors file has names, shapes and dtypes, not module types. Without a skeleton, a 2-d floating
# "<module>.weight" is taken for a Linear unless a path segment names an embedding; conv weights are 3-d+,
# norms 1-d. A model skeleton (meta device costs nothing) removes the guess.
def _is_linear_weight(name: str, t: torch.Tensor, linear: set[str] | None) -> bool:
    if linear is not None:
        return name in linear
    return (name.endswith(".weight") and t.dim() == 2 and t.is_floating_point()
            and not _EMBEDDING_SEGMENT.search(name.removesuffix(".weight")))


def _source_files(src: Path) -> list[Path]:
    if src.is_dir():
        single, index = src / "model.safetensors", src / ("model.safetensors" + INDEX_SUFFIX)
        src = single if single.exists() else index
    if not src.exists():
        raise CheckpointError(f"{src}: no such checkpoint (a .safetensors file, an {INDEX_SUFFIX}, or a directory)")
    if src.name.endswith(INDEX_SUFFIX):
        files, _ = read_index(src)
        return [src.parent / f for f in files]
    return [src]


class _ShardedOutput:
    """Streams (state name, stored tensors, entry) groups into shards of at most ``max_shard_bytes``; a group
    never straddles two shards. Shard names need the count, so every shard is finished at ``close``."""

    def __init__(self, dst: Path, max_shard_bytes: int | None):
        if max_shard_bytes is not None and max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.dst, self.limit = dst, max_shard_bytes
        self.shards: list[tuple[SafetensorsWriter, dict]] = []

    def add(self, name: str, tensors: list[tuple[str, torch.Tensor]], entry: dict | None) -> None:
        n = sum(t.numel() * t.element_size() for _, t in tensors)
        if not self.shards or (self.limit is not None and self.shards[-1][0].nbytes
                               and self.shards[-1][0].nbytes + n > self.limit):
            self.shards.append((SafetensorsWriter(self.dst.with_name(f"{self.dst.name}.part{len(self.shards)}")), {}))
        writer, weights = self.shards[-1]
        for stored, t in tensors:
            writer.add(stored, t)
        if entry is not None:
            weights[name] = entry

    def close(self, header: dict) -> None:
        if not self.shards:
            self.shards.append((SafetensorsWriter(self.dst), {}))
        paths = shard_paths(self.dst, len(self.shards))
        weight_map, total = {}, 0
        for (writer, weights), path in zip(self.shards, paths):
            writer.close(file_metadata({**header, "weights": weights}), path=path)
            weight_map.update(dict.fromkeys(writer.entries, path.name))
            total += writer.nbytes
        if len(paths) > 1:
            write_index(self.dst, header, weight_map, total)

    def abort(self) -> None:
        for writer, _ in self.shards:
            if not writer._data.closed:
                writer.abort()


class _Progress:
    """One line on stderr, redrawn per tensor: [#####-----] 12/40 tensors 45.3/130.0 MB  layers.3.mlp.up_proj.weight"""

    def __init__(self, total_bytes: int, total: int, enabled: bool, width: int = 30):
        self.total_bytes, self.total, self.enabled, self.width = max(total_bytes, 1), total, enabled, width
        self.done_bytes = self.count = 0
        self.start = time.perf_counter()

    def step(self, nbytes: int, name: str) -> None:
        self.done_bytes += nbytes
        self.count += 1
        if self.enabled:
            filled = self.width * self.done_bytes // self.total_bytes
            sys.stderr.write(f"\r[{'#' * filled}{'-' * (self.width - filled)}] {self.count}/{self.total} tensors "
                             f"{self.done_bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB  {name[-40:]:<40}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\n{self.count} tensors, {self.done_bytes / 1e6:.1f} MB in "
                             f"{time.perf_counter() - self.start:.1f} s\n")
