"""quantize_checkpoint: float safetensors checkpoint -> torchqkit checkpoint, one tensor at a time.

Which tensors are Linear weights (see Note [Linear weights in a checkpoint]):
  - with ``model=`` (any nn.Module, e.g. built on the meta device): exactly the weights of its nn.Linear
    modules, as quantize_ would pick them;
  - without: every 2-d floating ``<module>.weight`` except embeddings (a path segment containing "embed",
    GPT-2's "wte" / "wpe", T5's "shared"; or a tensor with the same data as one of those: a tied head) and
    weights stored transposed, (in, out), as GPT-2's Conv1D does (its c_attn / c_fc / c_proj, or any weight
    whose bias has dim 1's size, not dim 0's). Those are reported, never quantized; pass ``model=`` to be exact.
The config (QuantConfig or ModuleConfigs) then selects among those Linear weights by module name, as in
quantize_; everything else is copied unchanged.

Memory: the source is read with ``readinto`` one tensor at a time, the packed result is appended to a
temporary data file at once, and headers are written at the end (SafetensorsWriter); at any moment the
process holds one float tensor, its quantization temporaries and its packed form. Output files replace the
previous ones at ``dst`` only once all are written (Note [Atomic saves], atomic.py).
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch
from torch import nn

from ..api.configs.base import handler_for
from ..api.quantize import QuantizationError, as_module_configs, quantize_named_weight
from ..api.report import LayerReport, QuantizationReport
from ..progress import ProgressLine, progress_enabled
from .atomic import INDEX_SUFFIX, CheckpointFiles, files_a_save_replaces
from .entries import INNER_SEP, encode_entry
from .safetensors_file import CheckpointError, SafetensorsReader, SafetensorsWriter
from .save_load import file_header, file_metadata
from .shard_index import read_index, resolve_checkpoint_path, write_index

__all__ = ["quantize_checkpoint"]

_EMBEDDING_SEGMENT = re.compile(r"(^|\.)([^.]*embed[^.]*|wte|wpe|shared)(\.|$)", re.IGNORECASE)
_CONV1D_MODULE = re.compile(r"(^|\.)(c_attn|c_proj|c_fc|q_attn)$")  # GPT-2's Conv1D layers: weight (in, out)


def quantize_checkpoint(src, dst, config, *, model: nn.Module | None = None, max_shard_bytes: int | None = None,
                        strict: bool = False, progress: bool | None = None,
                        require_quantized: bool = False) -> QuantizationReport:
    """Quantize a float safetensors checkpoint file to file, without building the model.

    Streams the tensors of ``src``, one at a time: the Linear weights ``config`` selects are quantized, everything
    else is copied, and the result is a torchqkit checkpoint at ``dst`` that ``load_quantized`` (or the CLI) reads.
    Only one float tensor is held at a time. Linear weights are found from ``model`` when given, else guessed
    from names and shapes (embeddings and GPT-2 style Conv1D weights are told apart).
    Configs that need calibration data can't be used here: their weights are reported and copied in float.

    Args:
        src (str | os.PathLike): the float checkpoint: a ``.safetensors`` file, an ``.index.json``, or a directory.
        dst (str | os.PathLike): the ``.safetensors`` file to write; never one of the source files.
        config (QuantConfig | ModuleConfigs): what to quantize and how.
        model (torch.nn.Module | None): optional skeleton (e.g. on the meta device) naming the Linear modules;
            default None: guessed. Keyword-only, as are the arguments below.
        max_shard_bytes (int | None): shard the output past this size (with ``<dst>.index.json``); default None.
        strict (bool): raise ``QuantizationError``, writing nothing, if a selected weight can't be quantized, a
            weight the config names can't be told from a non-Linear, or a ``ModuleConfigs`` pattern selects
            nothing; default False (each is reported, the weight copied in float).
        progress (bool | None): a progress line on stderr, one step per tensor; default None: shown when
            stderr is a terminal.
        require_quantized (bool): raise ``QuantizationError``, writing nothing, if no weight was quantized in the
            end (the CLI sets it); default False.

    Returns:
        QuantizationReport: one entry per 2-d weight considered (and per unmatched config key).

    Raises:
        QuantizationError: with ``strict`` or ``require_quantized``, as above.
        CheckpointError: an unreadable source, or one that is already quantized.
        ValueError: ``dst`` would overwrite a source file.
        TypeError: ``config`` is not a config or ``ModuleConfigs``.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_checkpoint("model.safetensors", "model-int4.safetensors",
                                        qk.Int4WeightOnlyConfig(group_size=128))
        print(report)
        ```
    """
    configs = as_module_configs(config)
    for c in configs.configs.values():
        if c is not None:
            handler_for(c)
    readers = []
    try:
        sources = _source_files(Path(src))
        _refuse_destroying_sources(sources, Path(dst))
        for f in sources:
            readers.append(SafetensorsReader(f))
        _refuse_quantized_source(readers)
        linear, entries = _plan(readers, configs, model)
        if strict and any(e.status == "skipped" for e in entries):
            raise QuantizationError("quantize_checkpoint(strict=True), nothing written: " + "; ".join(
                f"{e.fqn}: {e.reason}" for e in entries if e.status == "skipped"))
        out = _ShardedOutput(Path(dst), max_shard_bytes)
        try:
            report = _convert_all(readers, linear, configs, out, strict, progress, entries)
            if require_quantized and not report.quantized:
                raise QuantizationError(_nothing_quantized(report, dst))
            out.close(config)
        except BaseException:
            out.abort()
            raise
    finally:
        for r in readers:
            r.close()
    return report


def _convert_all(readers, linear: set[str], configs, out: "_ShardedOutput", strict: bool, progress: bool | None,
                 entries: list[LayerReport]) -> QuantizationReport:
    """Stream every tensor into ``out``: the ``linear`` ones quantized as ``configs`` says, the rest copied."""
    names = [(r, n) for r in readers for n in r.names()]
    total_mb = sum(r.nbytes(n) for r, n in names) / 1e6
    bar = ProgressLine("quantize_checkpoint", len(names), "tensors", enabled=progress_enabled(progress))
    done_mb = 0.0
    converted = []
    for count, (reader, name) in enumerate(names, 1):
        if name in linear:
            converted.append(_convert_one(reader, name, configs, out, strict))
        else:
            out.add(name, [(name, reader.read(name))], None)
        done_mb += reader.nbytes(name) / 1e6
        bar.update(count, f"{done_mb:.1f}/{total_mb:.1f} MB {name[-40:]}")
    bar.close(f"{len(names)} tensors, {total_mb:.1f} MB in {bar.elapsed():.1f} s")
    return QuantizationReport(converted + entries)


def _nothing_quantized(report: QuantizationReport, dst) -> str:
    reasons = sorted({e.reason for e in report.entries if e.reason})
    return (f"no weight was quantized, so {dst} was not written ({len(report.entries)} considered"
            + (f"; reasons: {'; '.join(r[:160] for r in reasons[:3])}" if reasons else ": no 2-d weights") + ")")


def _convert_one(reader: SafetensorsReader, name: str, configs, out: "_ShardedOutput", strict: bool) -> LayerReport:
    tensor = reader.read(name)  # the only reference: freed once packed, before the packed form is written
    fqn = name.removesuffix(".weight")
    entry, w = quantize_named_weight(fqn, tensor, configs)
    if w is None:
        if strict and entry.status == "skipped":
            raise QuantizationError(f"quantize_checkpoint(strict=True): {fqn}: {entry.reason}")
        out.add(name, [(name, tensor)], None)
        return entry
    del tensor
    out.add(name, [(f"{name}{INNER_SEP}{n}", t) for n, t in w.inner_tensors().items() if t is not None],
            encode_entry(w))
    return entry


def _refuse_quantized_source(readers: list[SafetensorsReader]) -> None:
    for r in readers:
        packed = next((n for n in r.names() if INNER_SEP in n), None)
        if "torchqkit" in r.metadata or packed is not None:
            raise CheckpointError(f"{r.path}: this checkpoint is already quantized (a torchqkit checkpoint"
                                  + (f": tensor {packed!r:.100}" if packed else "")
                                  + "); quantize_checkpoint takes a float checkpoint. Load it with load_quantized")


# Note [Linear weights in a checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A safetensors file has names, shapes and dtypes, not module types. Without a skeleton, a 2-d floating
# "<module>.weight" is taken for a Linear unless something says it isn't one, and each such refusal is reported:
#   - an embedding: a path segment names one ("embed...", "wte", "wpe", T5's "shared"), or the tensor holds the
#     same bytes as such a tensor (a head tied to the embedding, saved twice). Quantizing it would quantize the
#     embedding, or break the tie the model re-creates on load.
#   - a weight stored (in, out): GPT-2's Conv1D (c_attn, c_fc, c_proj, q_attn), or any weight whose
#     "<module>.bias" has dim 1's size and not dim 0's. As a Linear its output would be garbage, and a square
#     one (c_proj) can't be told apart by shape at all.
# Conv weights are 3-d+, norms 1-d. A model skeleton (meta device costs nothing) removes the guess.
def _plan(readers, configs, model) -> tuple[set[str], list[LayerReport]]:
    """(names of the weights to quantize, report entries for the 2-d weights refused and for config keys that
    select nothing). Reads no tensor but the embeddings and their look-alikes (see _tied_to_embeddings)."""
    shapes = {n: (r.shape(n), r.dtype(n)) for r in readers for n in r.names()}
    candidates = [n for n, (shape, dtype) in shapes.items()
                  if n.endswith(".weight") and len(shape) == 2 and dtype.is_floating_point]
    refused = _refused_by_model(candidates, model) if model is not None else _refused_by_name(readers, candidates, shapes)
    entries = []
    for name, (reason, selected_is_error) in refused.items():
        fqn = name.removesuffix(".weight")
        nbytes = _nbytes(*shapes[name])
        key, config = configs.lookup(fqn)
        # Skipped (an error under strict=True) when the config asks for this very weight, or when a pattern /
        # _default selects what is probably a Linear we can't read; an embedding under _default is just kept.
        skipped = config is not None and (key == fqn or selected_is_error)
        entries.append(LayerReport(fqn, "skipped" if skipped else "kept",
                                   config.describe() if skipped else "-", reason, nbytes, nbytes))
    fqns = [n.removesuffix(".weight") for n in candidates]
    if model is not None:
        absent = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and f"{n}.weight" not in shapes
                  and configs.lookup(n)[1] is not None]
        entries += [LayerReport(n, "skipped", configs.lookup(n)[1].describe(), f"model= has this nn.Linear, the "
                                f"checkpoint has no {n}.weight", 0, 0) for n in absent if n not in configs.exact_keys()]
    entries += [LayerReport(k, "skipped", "-", "ModuleConfigs names a module the checkpoint does not have (no 2-d "
                            "weight of that name)", 0, 0) for k in configs.exact_keys() if k not in fqns]
    entries += [LayerReport(k, "skipped", "-", "ModuleConfigs pattern selects no weight of the checkpoint", 0, 0)
                for k in configs.unmatched(fqns)]
    return {n for n in candidates if n not in refused}, entries


def _refused_by_model(candidates, model: nn.Module) -> dict[str, tuple[str, bool]]:
    """name -> (reason, whether a config selecting it through a pattern / _default is an error) for the 2-d
    weights that aren't nn.Linear weights of ``model``."""
    modules = dict(model.named_modules())
    out = {}
    for name in candidates:
        m = modules.get(name.removesuffix(".weight"))
        if not isinstance(m, nn.Linear):
            kind = type(m).__name__ if m is not None else "no module of the model"
            out[name] = (f"{kind} is not an nn.Linear (model=)", False)
    return out


def _refused_by_name(readers, candidates, shapes) -> dict[str, tuple[str, bool]]:
    out = {}
    embeddings = [n for n in candidates if _EMBEDDING_SEGMENT.search(n.removesuffix(".weight"))]
    for n in embeddings:
        out[n] = ("an embedding by its name: embeddings are not quantized (pass model= to decide by module type)",
                  False)
    for name in candidates:
        if name in out:
            continue
        fqn = name.removesuffix(".weight")
        (d0, d1), _ = shapes[name]
        bias = shapes.get(f"{fqn}.bias", ((),))[0]
        if _CONV1D_MODULE.search(fqn) or (bias == (d1,) and d0 != d1):
            out[name] = (f"looks like GPT-2's Conv1D, whose weight is stored (in, out) = ({d0}, {d1}) "
                         f"({'its name' if _CONV1D_MODULE.search(fqn) else f'its bias has {d1} elements'}): as a "
                         f"Linear it would compute garbage. Pass model= to quantize exactly the nn.Linear weights",
                         True)
    for name, twin in _tied_to_embeddings(readers, [n for n in candidates if n not in out], embeddings, shapes):
        out[name] = (f"same data as the embedding {twin} (tied): embeddings are not quantized", False)
    return out


def _tied_to_embeddings(readers, names, embeddings, shapes):
    """(name, embedding) for tensors holding the same bytes as an embedding: a tied head saved twice. Reads only
    the embeddings and the tensors of their exact shape and dtype, one at a time."""
    where = {n: r for r in readers for n in r.names()}
    digests = {}
    for e in embeddings:
        digests.setdefault((shapes[e], _digest(where[e], e)), e)
    for name in names:
        if any(shapes[name] == key[0] for key in digests):
            twin = digests.get((shapes[name], _digest(where[name], name)))
            if twin is not None:
                yield name, twin


def _digest(reader: SafetensorsReader, name: str) -> bytes:
    return hashlib.blake2b(memoryview(reader.read(name).reshape(-1).view(torch.uint8).numpy())).digest()


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same inode (hard links, symlinks, '..') or, for a path that doesn't
    exist yet, the same resolved name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _refuse_destroying_sources(sources: list[Path], dst: Path) -> None:
    """A save at ``dst`` writes or removes the files ``files_a_save_replaces`` lists: none may be a source file,
    or quantizing would replace (or delete) the float checkpoint it is reading. Checked before anything is read
    or written."""
    for target in files_a_save_replaces(dst):
        for source in sources:
            if _same_file(source, target):
                how = "is" if target == dst else f"would write or remove {target}, which is"
                raise ValueError(f"quantize_checkpoint: the destination {dst} {how} the source file {source} (the "
                                 f"same file, by name, link or path); writing it would destroy the float checkpoint "
                                 f"being read. Nothing was written: choose another destination.")


def _source_files(src: Path) -> list[Path]:
    src = resolve_checkpoint_path(src)
    if src.name.endswith(INDEX_SUFFIX):
        files, _, _ = read_index(src)
        return [src.parent / f for f in files]
    return [src]


class _ShardedOutput:
    """Streams (state name, stored tensors, entry) groups into shards of at most ``max_shard_bytes``; a group
    never straddles two shards. Shard names need the count, so every shard is finished at ``close``, and all of
    them (plus the index) replace the previous checkpoint at ``dst`` together (Note [Atomic saves])."""

    def __init__(self, dst: Path, max_shard_bytes: int | None):
        if max_shard_bytes is not None and max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.files = CheckpointFiles(dst)
        self.dst, self.limit = dst, max_shard_bytes
        self.shards: list[tuple[SafetensorsWriter, dict]] = []

    def add(self, name: str, tensors: list[tuple[str, torch.Tensor]], entry: dict | None) -> None:
        n = sum(t.numel() * t.element_size() for _, t in tensors)
        if not self.shards or (self.limit is not None and self.shards[-1][0].nbytes
                               and self.shards[-1][0].nbytes + n > self.limit):
            self.shards.append((SafetensorsWriter(self.dst), {}))
        writer, weights = self.shards[-1]
        for stored, t in tensors:
            writer.add(stored, t)
        if entry is not None:
            weights[name] = entry

    def close(self, config) -> None:
        if not self.shards:
            self.shards.append((SafetensorsWriter(self.dst), {}))
        paths = self.files.shard_paths(len(self.shards))
        header = file_header(config, {}, self.files.save_id if len(paths) > 1 else None)
        weight_map, total = {}, 0
        for (writer, weights), path in zip(self.shards, paths):
            self.files.stage(writer.finish(file_metadata({**header, "weights": weights}), path), path)
            weight_map.update(dict.fromkeys(writer.entries, path.name))
            total += writer.nbytes
        if len(paths) > 1:
            write_index(self.files, header, weight_map, total)
        self.files.commit()

    def abort(self) -> None:
        for writer, _ in self.shards:
            writer.abort()
        self.files.discard()
