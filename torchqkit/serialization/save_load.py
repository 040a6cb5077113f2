"""save_quantized / load_quantized: quantized models in safetensors files, no pickle.

Note [torchqkit safetensors format]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A plain safetensors file. A float tensor is stored under its state-dict name. A quantized weight ``w`` is
stored as its layout's packed tensors, each under ``"w:<inner>"`` (e.g. ``lm_head.weight:qdata``), bytes
exactly as the layout packs them (device-independent, see docs/architecture.md). ``__metadata__`` holds
  "format": "pt", "torchqkit_format": "1", and
  "torchqkit": JSON {"format_version": 1, "torchqkit_version": "0.1.0",
                     "config": null | {"config": <QuantConfig.to_dict()>}
                               | {"module_configs": <ModuleConfigs.to_dict()>},
                     "weights": {"w": <entry, see entries.py>, ...},   # the quantized weights of this file
                     "tied": {"lm_head.weight": "embed.weight", ...}}  # aliases stored once
Past ``max_shard_bytes`` the tensors go to ``<stem>-<save id>-00001-of-0000N.safetensors`` (a quantized weight's
tensors always share a shard), each with the header above for its own weights plus "save_id", and
``<name>.index.json`` = {"metadata": {"torchqkit": <same JSON, "weights": {}>, "total_size": n},
"weight_map": {stored tensor name: shard file name}} (Hugging Face's index layout). The save id (8 hex digits,
new for every save) ties the shards to their index, see Note [Atomic saves] in atomic.py.

Note [Shard headers]
~~~~~~~~~~~~~~~~~~~~
save_quantized gives each shard the entries of the weights it holds (a weight's tensors share a shard).
transformers' ``model.save_pretrained`` (through the torchqkit quantizer) writes one ``__metadata__`` into every
shard and splits tensors where it likes: so a loader also accepts shards that all carry the same whole-model
header, and finds each stored tensor in whichever shard holds it. That header (flat_state_dict) has a save id new
for every save too, so whoever cut the shards, every shard of a checkpoint names the save that wrote it: a
checkpoint of several files is loaded only if every shard carries a save id and all are the same (shards of two
saves of one model would otherwise load as a third model, since their headers are otherwise equal).

Loading reads and validates every header first (format version, entries against the layout/qdtype
registries, stored shapes against ``Layout.packed_specs``, names against the model), so a bad file changes
nothing; then it reads one tensor at a time into fresh allocations and assigns it to the model, which can
live on the meta device: no float weight of a quantized layer is ever built.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..files.strict_json import parse_json
from ..progress import ProgressLine, progress_enabled
from ..version import __version__
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .atomic import INDEX_SUFFIX, CheckpointFiles, new_save_id
from .dtensor_load import holds_quantized, plan_shards, read_shard
from .entries import INNER_SEP, check_tensors, decode_entry, encode_entry, entry_error, quote
from .qparams import check_qparams
from .safetensors_file import CheckpointError, SafetensorsReader, SafetensorsWriter
from .shard_index import check_save_id, read_index, resolve_checkpoint_path, write_index

__all__ = ["save_quantized", "load_quantized", "SaveSummary", "FORMAT_VERSION", "read_checkpoint_info",
           "flat_state_dict", "open_checkpoint", "read_quantized_weight", "check_model_shapes", "check_against_model",
           "encode_config",
           "decode_config"]

FORMAT_VERSION = 1
_VERSION = re.compile(r"\d+(\.\d+){0,3}[\w.+-]{0,20}")  # quoted in errors only if it looks like one
_SAVE_ID = re.compile(r"[0-9a-f]{8}")


@dataclass
class SaveSummary:
    files: list[Path]
    quantized: list[str] = field(default_factory=list)   # state-dict names stored as packed tensors
    plain: list[str] = field(default_factory=list)       # stored as they are
    tied: dict[str, str] = field(default_factory=dict)   # alias -> the name it is stored under
    nbytes: int = 0
    notes: list[str] = field(default_factory=list)       # anything else worth telling (save_pretrained)

    def __str__(self) -> str:
        lines = [f"{a} is tied to {t}: stored once" for a, t in self.tied.items()] + self.notes
        return (f"saved {len(self.quantized)} quantized + {len(self.plain)} plain tensors, {self.nbytes:,} bytes, "
                f"to {', '.join(str(f) for f in self.files)}" + "".join(f"\n  {line}" for line in lines))


# ---------------------------------------------------------------------------------------------- save

def save_quantized(model_or_state_dict, path, *, max_shard_bytes: int | None = None, config=None) -> SaveSummary:
    """Write every tensor of a model (or state dict), quantized or not, to a safetensors checkpoint at ``path``.

    Quantized weights are stored as their layout's packed tensors (``"<name>:qdata"``, ...), bytes exactly as the
    layout packs them, with a JSON header describing each; float tensors as they are; tied aliases (an lm_head
    sharing the embedding) once. No pickle. The save is atomic: all files are written or none. Read it back with
    ``load_quantized``.

    Args:
        model_or_state_dict (torch.nn.Module | dict[str, torch.Tensor]): the (quantized) model or its state dict.
        path (str | os.PathLike): the ``.safetensors`` file to write (shards get derived names).
        max_shard_bytes (int | None): past this many bytes, write several shards plus ``<path>.index.json``
            (Hugging Face's index layout); a quantized weight's tensors always share a shard. None (default): one
            file. Keyword-only.
        config (QuantConfig | ModuleConfigs | None): the config that produced the weights, recorded in the header;
            default None. Keyword-only.

    Returns:
        SaveSummary: the files written, the quantized and plain tensor names, the tied aliases stored once and
            the bytes written; ``print()`` it for a summary.

    Raises:
        ValueError: a tensor on the meta device, or a tensor name containing the reserved ``":"``.

    Example:
        ```python
        import torchqkit as qk
        config = qk.Int4WeightOnlyConfig(group_size=128)
        qk.quantize_(model, config)
        print(qk.save_quantized(model, "model-int4.safetensors", config=config))
        ```
    """
    groups, tied = _stored_groups(model_or_state_dict)
    shards = _plan_shards(groups, max_shard_bytes)
    out = CheckpointFiles(path)  # see Note [Atomic saves]: all files or none
    header = file_header(config, tied, out.save_id if len(shards) > 1 else None)
    files = out.shard_paths(len(shards))
    summary = SaveSummary(list(files), tied=dict(tied))
    weight_map, writers = {}, []
    try:
        for file, shard in zip(files, shards):
            writer = SafetensorsWriter(file)
            writers.append(writer)
            weights = {}
            for name, inner, entry in shard:
                for stored, t in inner:
                    writer.add(stored, t)
                    weight_map[stored] = file.name
                (summary.quantized if entry else summary.plain).append(name)
                if entry:
                    weights[name] = entry
            out.stage(writer.finish(file_metadata({**header, "weights": weights})), file)
            summary.nbytes += writer.nbytes
        if len(shards) > 1:
            summary.files.append(write_index(out, header, weight_map, summary.nbytes))
        out.commit()
    except BaseException:
        for writer in writers:
            writer.abort()
        out.discard()
        raise
    return summary


def _stored_groups(model_or_state_dict):
    """[(state name, [(stored name, tensor)], entry or None)] in state-dict order, and the tied aliases."""
    state, tied = _named_tensors(model_or_state_dict)
    groups = []
    for name, t in state.items():
        if INNER_SEP in name:
            raise ValueError(f"tensor name {name!r} contains {INNER_SEP!r}, which the format reserves")
        if t.is_meta:
            raise ValueError(f"tensor {name!r} is on the meta device: there is nothing to save")
        if isinstance(t, AffineQuantizedTensor):
            inner = [(f"{name}{INNER_SEP}{n}", v) for n, v in t.inner_tensors().items() if v is not None]
            groups.append((name, inner, encode_entry(t)))
        else:
            groups.append((name, [(name, t)], None))
    return groups, tied


def flat_state_dict(model_or_state_dict, config=None):
    """The tensors and ``__metadata__`` of a one-file checkpoint, for writers other than save_quantized
    (transformers' save_pretrained writes them): ({stored name: tensor}, the metadata with every weight's entry,
    {alias: stored name} for the tied aliases stored once)."""
    groups, tied = _stored_groups(model_or_state_dict)
    tensors = {stored: t for _, inner, _ in groups for stored, t in inner}
    weights = {name: entry for name, _, entry in groups if entry is not None}
    # The writer may cut shards; a fresh save id in the header they all carry ties them together (Note [Shard
    # headers]).
    return tensors, file_metadata({**file_header(config, tied, new_save_id()), "weights": weights}), tied


def file_header(config, tied: dict[str, str], save_id: str | None = None) -> dict:
    """The torchqkit header shared by every shard (each adds its own "weights"). A sharded save also records
    its save id, which names its shards and ties them to its index (see Note [Atomic saves])."""
    header = {"format_version": FORMAT_VERSION, "torchqkit_version": torchqkit_version(),
              "config": encode_config(config), "tied": tied}
    return header if save_id is None else {**header, "save_id": save_id}


def _is_dtensor(t) -> bool:
    import sys
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor can exist
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _named_tensors(obj) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor without aliases, alias -> stored name). Aliases: the same Parameter object in a
    module (tied weights), or, in a state dict, the same object / the same data, shape and strides."""
    if isinstance(obj, nn.Module):
        obj = getattr(obj, "_orig_mod", obj)  # torch.compile's wrapper
        obj = obj.state_dict(keep_vars=True)
    if not isinstance(obj, dict):
        raise TypeError(f"save_quantized takes an nn.Module or a state dict, got {type(obj).__name__}")
    out, tied, seen = {}, {}, {}
    for name, t in obj.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if _is_dtensor(t):
            raise TypeError(f"{name!r} is a DTensor (sharded by parallelize_module or fully_shard): a checkpoint holds "
                            f"whole tensors, and this rank has only its shard. Save the quantized model before "
                            f"sharding it: load_quantized onto the parallelized meta-device model then reads only "
                            f"each rank's shard of that checkpoint")
        key = _alias_key(t)
        if key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        out[name] = t.detach() if not isinstance(t, AffineQuantizedTensor) else t
    return out, tied


def _alias_key(t: torch.Tensor):
    if isinstance(t, AffineQuantizedTensor) or t.is_meta or t.numel() == 0:
        return ("id", id(t))
    return ("data", t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _plan_shards(groups, max_shard_bytes):
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards, size = [[]], 0
    for g in groups:
        n = sum(t.numel() * t.element_size() for _, t in g[1])
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += n
    return shards


def file_metadata(header: dict) -> dict[str, str]:
    return {"format": "pt", "torchqkit_format": str(FORMAT_VERSION), "torchqkit": json.dumps(header)}


def encode_config(config):
    from ..api.configs.base import QuantConfig
    from ..api.module_configs import ModuleConfigs
    if config is None:
        return None
    if isinstance(config, ModuleConfigs):
        return {"module_configs": config.to_dict()}
    if isinstance(config, QuantConfig):
        return {"config": config.to_dict()}
    raise TypeError(f"config must be a QuantConfig or ModuleConfigs, got {type(config).__name__}")


def torchqkit_version() -> str:
    return __version__


# ---------------------------------------------------------------------------------------------- load

@dataclass
class _Checkpoint:
    """Validated headers of one checkpoint (a file, or the shards of an index)."""
    path: Path
    readers: dict[str, SafetensorsReader]          # shard file name -> reader
    where: dict[str, str]                          # stored tensor name -> shard file name
    weights: dict[str, dict]                       # quantized state name -> AffineQuantizedTensor kwargs
    inner: dict[str, list[str]]                    # quantized state name -> its inner tensor names
    plain: list[str]
    tied: dict[str, str]
    config: object

    def close(self):
        for r in self.readers.values():
            r.close()


def read_checkpoint_info(path) -> dict:
    """The validated header of a torchqkit checkpoint: {"config": QuantConfig | ModuleConfigs | None,
    "quantized": [names], "plain": [names], "tied": {alias: name}}. Reads no tensor data."""
    ckpt = _open_checkpoint(path)
    ckpt.close()
    return {"config": ckpt.config, "quantized": list(ckpt.weights), "plain": list(ckpt.plain), "tied": dict(ckpt.tied)}


def open_checkpoint(path) -> _Checkpoint:
    """The validated headers of a checkpoint (a file, an index, or a directory holding model.safetensors), its
    readers open: ``.weights`` (state name -> AffineQuantizedTensor attributes), ``.plain``, ``.tied``,
    ``.config``; read_quantized_weight reads one weight. Close it with ``.close()``. Reads no tensor data."""
    return _open_checkpoint(path)


def read_quantized_weight(ckpt: _Checkpoint, name: str, tensors: dict[str, torch.Tensor] | None = None):
    """The AffineQuantizedTensor stored as ``name``: from ``tensors`` (inner name -> tensor, already read by the
    caller) when given, else read from the checkpoint's files. The inner names must be the entry's."""
    if tensors is not None and sorted(tensors) != sorted(ckpt.inner[name]):
        raise CheckpointError(f"{ckpt.path}: quantized weight {name!r} is stored as {sorted(ckpt.inner[name])}, "
                              f"got {sorted(tensors)}")
    return _read_one(ckpt, name, tensors)


def load_quantized(model: nn.Module, path, *, progress: bool | None = None) -> nn.Module:
    """Fill ``model`` with a checkpoint written by ``save_quantized`` or ``quantize_checkpoint``, and return it.

    Quantized weights become ``AffineQuantizedTensor``s built straight from the stored packed tensors, so the model
    can be built on the meta device and no float weight of a quantized layer is ever materialized. Every header,
    entry, shape and qparam value is validated before the model is touched; tied aliases are tied again. A
    tensor-parallel model (DTensor parameters, e.g. ``parallelize_module`` on the meta device) gets on each rank only
    its shard of every tensor, read from the file by itself.

    Args:
        model (torch.nn.Module): the model skeleton (on the meta device, or a float model) with the checkpoint's
            architecture; filled in place.
        path (str | os.PathLike): the ``.safetensors`` file, its ``.index.json``, or a directory holding them.
        progress (bool | None): a progress line on stderr, one step per tensor; default None: shown when
            stderr is a terminal.

    Returns:
        torch.nn.Module: ``model``, filled.

    Raises:
        CheckpointError: an unreadable, inconsistent or corrupt checkpoint, or one that doesn't fit the model
            (names, shapes); the message names the file, the tensor and the problem.

    Example:
        ```python
        import torch
        import torchqkit as qk
        with torch.device("meta"):
            model = MyModel()
        model = qk.load_quantized(model, "model-int4.safetensors")
        ```
    """
    target = getattr(model, "_orig_mod", model)
    ckpt = _open_checkpoint(path, check_values=False)
    try:
        expected = target.state_dict(keep_vars=True)
        check_against_model(ckpt, expected)
        # Tensor-parallel (DTensor) entries: this rank reads, and checks, only its part of each.
        shards = plan_shards(ckpt, expected)
        check_qparams(ckpt, skip={ckpt.tied.get(n, n) for n in shards})
        shard_values = {name: read_shard(ckpt, name, plan) for name, plan in shards.items()}
        loaded: dict[str, torch.Tensor] = {}
        bar = ProgressLine(f"load_quantized {Path(path).name}", len(expected), "tensors",
                           enabled=progress_enabled(progress))
        for count, name in enumerate(expected, 1):
            if name not in ckpt.tied:
                value = shard_values.pop(name) if name in shards else _read_one(ckpt, name)
                loaded[name] = _assign(target, name, value, expected[name])
            bar.update(count, name[-40:])
        bar.close()
        for alias, name in ckpt.tied.items():
            _set_tensor(target, alias, loaded[name] if name in loaded else _read_one(ckpt, name))
    finally:
        ckpt.close()
    _check_no_meta(target)
    return model


def _open_checkpoint(path, check_values: bool = True) -> _Checkpoint:
    path = resolve_checkpoint_path(path)
    if path.name.endswith(INDEX_SUFFIX):
        files, where, save_id = read_index(path)
    else:
        files, where, save_id = [path.name], None, None
    readers = {}
    try:
        for f in files:
            readers[f] = SafetensorsReader(path.parent / f)
        ckpt = _build_checkpoint(path, readers, where)
        if where is not None:
            first = next(iter(readers.values()))
            check_save_id(path, save_id, first.path.name, _torchqkit_header(first).get("save_id"))
        if check_values:
            check_qparams(ckpt)
        return ckpt
    except BaseException:
        for r in readers.values():
            r.close()
        raise


def _build_checkpoint(path: Path, readers: dict[str, SafetensorsReader], where) -> _Checkpoint:
    headers = {fname: _torchqkit_header(reader) for fname, reader in readers.items()}
    if len(headers) > 1:
        _check_one_save(readers, headers)
    shared = None
    for fname, header in headers.items():
        common = {k: v for k, v in header.items() if k != "weights"}
        if shared is not None and common != shared:
            raise CheckpointError(f"{readers[fname].path}: its torchqkit header (config, tied) differs from the "
                                  f"other shards'")
        shared = common
    stored_in = {}
    for fname, reader in readers.items():
        for stored in reader.names():
            if stored in stored_in:
                raise CheckpointError(f"{reader.path}: tensor {stored!r} is also stored in {stored_in[stored]}")
            stored_in[stored] = fname
    # See Note [Shard headers]: one header per shard, or the same whole-model header in every shard.
    whole_model = len(headers) > 1 and all(h["weights"] == next(iter(headers.values()))["weights"]
                                           for h in headers.values())
    weights, inner = {}, {}
    for fname, header in headers.items():
        for name, entry in header["weights"].items():
            if name in weights and whole_model:
                continue
            if name in weights:
                raise CheckpointError(f"{readers[fname].path}: quantized weight {name!r} described in two shards")
            locate = ((lambda stored: readers.get(stored_in.get(stored))) if whole_model
                      else (lambda stored, r=readers[fname]: r if stored in r.entries else None))
            weights[name], inner[name] = _validate_weight(readers[fname].path, name, entry, locate)
    if where is not None and where != stored_in:
        bad = sorted(set(where.items()) ^ set(stored_in.items()))[0]
        raise CheckpointError(f"{path}: the index says tensor {bad[0]!r} is in {bad[1]}, the shards disagree "
                              f"(missing or extra tensor)")
    owned = {f"{w}{INNER_SEP}{n}" for w, names in inner.items() for n in names}
    plain = []
    for stored, fname in stored_in.items():
        if INNER_SEP in stored and stored not in owned:
            raise CheckpointError(f"{readers[fname].path}: extra tensor {stored!r}: no quantized weight entry "
                                  f"claims it")
        if INNER_SEP not in stored:
            plain.append(stored)
    tied = _check_tied(path, shared["tied"], set(plain) | set(weights))
    config = decode_config(path, shared["config"])
    return _Checkpoint(path, readers, stored_in, weights, inner, plain, tied, config)


def _check_one_save(readers: dict[str, SafetensorsReader], headers: dict[str, dict]) -> None:
    """Every shard of a checkpoint of several files was written by one save (Note [Shard headers])."""
    first = next(iter(headers))
    for fname, header in headers.items():
        if "save_id" not in header:
            raise CheckpointError(f"{readers[fname].path}: this shard's torchqkit header has no save id, so nothing "
                                  f"shows it belongs with the other shards (they could come from different saves). "
                                  f"Save the model again with this torchqkit (save_quantized, save_pretrained or "
                                  f"model.save_pretrained)")
        if header["save_id"] != headers[first]["save_id"]:
            raise CheckpointError(f"{readers[fname].path}: shard written by another save than {first} (save ids "
                                  f"differ): shards of two saves are mixed. Copy the whole checkpoint from one save")


def _torchqkit_header(reader: SafetensorsReader) -> dict:
    meta = reader.metadata
    if "torchqkit" not in meta:
        raise CheckpointError(f"{reader.path}: not a torchqkit checkpoint (no 'torchqkit' entry in __metadata__); "
                              f"float checkpoints load with safetensors.torch.load_file / quantize_checkpoint")
    header = parse_json(meta["torchqkit"], f"{reader.path}: the torchqkit header", CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{reader.path}: the torchqkit header must be a JSON object")
    version = header.get("format_version")
    if type(version) is not int or version < 1:
        raise CheckpointError(f"{reader.path}: format_version must be a positive int")
    if version > FORMAT_VERSION:
        writer = header.get("torchqkit_version")
        writer = writer if isinstance(writer, str) and _VERSION.fullmatch(writer) else "a newer version"
        raise CheckpointError(f"{reader.path}: written in torchqkit format {version} by torchqkit "
                              f"{writer}; this torchqkit ({torchqkit_version()}) "
                              f"reads formats up to {FORMAT_VERSION}: upgrade torchqkit")
    if meta.get("torchqkit_format") != str(version):
        raise CheckpointError(f"{reader.path}: __metadata__ torchqkit_format disagrees with the header's "
                              f"format_version {version}")
    if "save_id" in header and not (isinstance(header["save_id"], str) and _SAVE_ID.fullmatch(header["save_id"])):
        raise CheckpointError(f"{reader.path}: save_id must be 8 hex digits")
    for key, kind in (("weights", dict), ("tied", dict)):
        if not isinstance(header.get(key), kind):
            raise CheckpointError(f"{reader.path}: the torchqkit header needs '{key}' ({kind.__name__})")
    if "config" not in header:
        raise CheckpointError(f"{reader.path}: the torchqkit header needs 'config' (null when unknown)")
    return header


def _validate_weight(path, name: str, entry, locate) -> tuple[dict, list[str]]:
    """Decode one header entry and check its stored tensors; ``locate(stored name)``: the reader holding it."""
    try:
        attrs = decode_entry(entry)
    except ValueError as e:
        raise entry_error(path, name, f"bad header entry: {e}") from None
    stored = entry["tensors"]
    found = {n: locate(f"{name}{INNER_SEP}{n}") for n in stored}
    missing = [n for n, r in found.items() if r is None]
    if missing:
        raise entry_error(path, name, f"missing tensor {name}{INNER_SEP}{missing[0]} (the entry lists it)")
    shapes = {n: r.shape(f"{name}{INNER_SEP}{n}") for n, r in found.items()}
    dtypes = {n: r.dtype(f"{name}{INNER_SEP}{n}") for n, r in found.items()}
    try:
        check_tensors(attrs, stored, shapes, dtypes)
    except ValueError as e:
        raise entry_error(path, name, str(e)) from None
    return attrs, stored


def _check_tied(path, tied, names: set[str]) -> dict[str, str]:
    for alias, target in tied.items():
        if not isinstance(target, str) or target not in names:
            raise CheckpointError(f"{path}: tensor {alias!r} is tied to {quote(target)}, which the file doesn't store")
        if alias in names:
            raise CheckpointError(f"{path}: tensor {alias!r} is both stored and tied to {target!r}")
    return dict(tied)


def decode_config(path, d):
    """A recorded config ({"config": ...} / {"module_configs": ...} / None) as a QuantConfig / ModuleConfigs."""
    from ..api.configs.base import config_from_dict
    from ..api.module_configs import ModuleConfigs
    if d is None:
        return None
    try:
        if isinstance(d, dict) and set(d) == {"config"}:
            return config_from_dict(d["config"])
        if isinstance(d, dict) and set(d) == {"module_configs"}:
            return ModuleConfigs(d["module_configs"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: the recorded quantization config is invalid: {e}") from None
    raise CheckpointError(f"{path}: config must be null, {{'config': ...}} or {{'module_configs': ...}}")


def check_against_model(ckpt: _Checkpoint, expected: dict) -> None:
    """The checkpoint fits the model whose state dict (name -> tensor) is ``expected``: every tensor stored or tied,
    nothing extra, shapes and kinds of dtype equal. Both loaders run it (Note [One validation for both loaders],
    hf.py) before any tensor is read."""
    _check_names(ckpt, expected)
    check_model_shapes(ckpt, expected)


def _check_names(ckpt: _Checkpoint, expected: dict) -> None:
    have = set(ckpt.plain) | set(ckpt.weights) | set(ckpt.tied)
    missing = [n for n in expected if n not in have]
    extra = sorted(have - set(expected))
    if missing:
        raise CheckpointError(f"{ckpt.path}: missing tensor {missing[0]!r}: the model has it, the checkpoint doesn't"
                              + (f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""))
    if extra:
        raise CheckpointError(f"{ckpt.path}: extra tensor {extra[0]!r}: the checkpoint has it, the model doesn't"
                              + (f" (and {len(extra) - 1} more: {extra[1:6]})" if len(extra) > 1 else ""))


def check_model_shapes(ckpt: _Checkpoint, expected: dict) -> None:
    """Each of ``expected``'s tensors (state name -> the model's tensor) has the checkpoint's shape and kind of
    dtype; CheckpointError naming the file and tensor otherwise."""
    for name, cur in expected.items():
        name = ckpt.tied.get(name, name)
        if name in ckpt.weights:
            a = ckpt.weights[name]
            shape, dtype = a["logical_shape"], a["orig_dtype"]
            if a["transposed"]:  # the last two dims swap (a stack of experts keeps its expert dim first)
                shape = (*shape[:-2], shape[-1], shape[-2])
        else:
            reader = ckpt.readers[ckpt.where[name]]
            shape, dtype = reader.shape(name), reader.dtype(name)
        if tuple(cur.shape) != tuple(shape) and not (name in ckpt.weights and _is_1x1_conv_of(cur.shape, shape)):
            raise CheckpointError(f"{ckpt.path}: tensor {name!r} has shape {list(shape)}, "
                                  f"the model's is {list(cur.shape)}")
        if dtype.is_floating_point != cur.dtype.is_floating_point:
            raise CheckpointError(f"{ckpt.path}: tensor {name!r} has dtype {dtype}, the model's is {cur.dtype}")


def _is_1x1_conv_of(model_shape, stored_shape) -> bool:
    """A float 1x1 convolution's weight (out, in, 1[, 1]) that the stored quantized (out, in) weight replaces:
    quantize_ stores a 1x1 conv's weight 2-d (Note [Weight-bearing modules] in api/weight_modules.py), so a float
    model loads it as a model quantized first would."""
    return (len(model_shape) in (3, 4) and len(stored_shape) == 2 and tuple(model_shape[:2]) == tuple(stored_shape)
            and all(d == 1 for d in model_shape[2:]))


def _read_one(ckpt: _Checkpoint, name: str, given: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    if name not in ckpt.weights:
        return ckpt.readers[ckpt.where[name]].read(name)
    tensors = dict.fromkeys(ckpt.weights[name]["qlayout"].tensor_names)
    for inner in ckpt.inner[name]:
        stored = f"{name}{INNER_SEP}{inner}"
        tensors[inner] = given[inner] if given is not None else ckpt.readers[ckpt.where[stored]].read(stored)
    return AffineQuantizedTensor(tensors, **ckpt.weights[name])


def _assign(model: nn.Module, name: str, value: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    if isinstance(current, nn.Parameter):
        grad = current.requires_grad and value.is_floating_point() and not holds_quantized(value)
        value = nn.Parameter(value, requires_grad=grad)
    _set_tensor(model, name, value)
    return value


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    from ..api.quantize import patch_extra_repr
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value
    if isinstance(value, AffineQuantizedTensor) and attr == "weight":  # a Linear, or an embedding tied to one
        patch_extra_repr(module)


def _check_no_meta(model: nn.Module) -> None:
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"after loading, {left[:5]} are still on the meta device: they are not in the checkpoint "
                         f"(non-persistent buffers are not saved). Build the model with only its parameters on the "
                         f"meta device, or fill these before use (torchqkit.from_pretrained does for transformers "
                         f"models)")
