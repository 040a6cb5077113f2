"""Hugging Face transformers models: save_pretrained / from_pretrained for quantized models.

    qk.quantize_(model, configs)                       # any transformers PreTrainedModel
    qk.save_pretrained(model, "out/", config=configs)  # out/config.json + out/model.safetensors
    model = qk.from_pretrained("out/")                 # one call: skeleton on meta, packed weights, ready to run

config.json is the model's own, plus ``"quantization_config"``: {"quant_method": "torchqkit", "format_version",
"torchqkit_version", "config" (the producing config, as in the checkpoint header), "quantized" (modules whose
weight is quantized), "modules_not_to_convert" (Linear modules left in float), "tied" (aliases stored once)}.
transformers' from_pretrained reads it through the registered quantizer (integrations/transformers_quantizer.py).

Note [One validation for both loaders]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchqkit.from_pretrained and transformers' from_pretrained (through the quantizer) check a checkpoint with the
same functions, so a file one of them refuses the other refuses too:
  - config.json is parsed strictly (read_config_json: files/strict_json.py, so NaN, a key given twice, nesting
    deeper than MAX_JSON_DEPTH are errors naming the file), and its quantization_config is checked field by field
    (check_quantization_config: quant_method, format_version, every field's type, no unknown field, the recorded
    config decodable). torchqkit.from_pretrained does both before transformers parses the file. transformers'
    path parses it first, leniently; then TorchqkitConfig.from_dict runs check_quantization_config when the
    quantizer is created, and the quantizer runs both on the checkpoint's own config.json, with its path, before
    any weight is read. (So a config.json nested deeper than Python's recursion limit fails inside transformers'
    own parse, before any torchqkit code runs, with transformers' RecursionError; torchqkit.from_pretrained
    refuses it naming the file.)
  - the safetensors headers are validated by serialization.save_load.open_checkpoint (format version, save ids,
    entries, stored shapes, qparam values), and the tensor names and shapes against the model by
    check_against_model (every model tensor stored or tied, nothing extra, shapes equal) in both.

Tied embeddings: quantize_ keeps a tie (see Note [Shared weights] in api/quantize.py). A float lm_head (the
default) and a quantized one named in ModuleConfigs are both one Parameter shared with the input embedding:
stored once, ``tie_word_embeddings`` stays true, and from_pretrained gives the embedding and lm_head the same
Parameter again (the embedding reads the quantized rows it needs, see Note [Quantized embedding]).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from .files.atomic_write import atomic_write_bytes
from .files.open_checked import open_regular_file
from .files.strict_json import MAX_JSON_DEPTH, json_depth, parse_json
from .serialization.safetensors_file import CheckpointError
from .serialization.save_load import (FORMAT_VERSION, SaveSummary, decode_config, encode_config, load_quantized,
                                      save_quantized, torchqkit_version)
from .tensor.affine_quantized_tensor import AffineQuantizedTensor

__all__ = ["save_pretrained", "from_pretrained", "quantization_record", "QUANT_METHOD", "read_config_json",
           "check_quantization_config", "check_format_version", "CHECKPOINT_IMPORTERS"]

QUANT_METHOD = "torchqkit"

# quant_method -> loader(directory, progress=...) of checkpoints other tools wrote that from_pretrained reads into
# torchqkit layouts (GPTQ, AWQ, compressed-tensors: integrations/hub_import.py fills it; integrations sit above
# this module in the layers, so they register here instead of being imported).
CHECKPOINT_IMPORTERS: dict = {}


def save_pretrained(model: nn.Module, directory, config=None, *, max_shard_bytes: int | None = None) -> SaveSummary:
    """Write a (quantized) transformers model to ``directory`` in a form both loaders read.

    Writes ``config.json`` (the model's own config plus a ``"quantization_config"`` recording the torchqkit config,
    the quantized modules, the Linear modules left in float and the tied aliases) and ``model.safetensors`` (as
    ``save_quantized`` writes it; shards plus an index past ``max_shard_bytes``). Load it with
    ``torchqkit.from_pretrained`` or transformers' ``from_pretrained``.

    Args:
        model (transformers.PreTrainedModel): the model (quantized with ``quantize_``, or not); a
            ``torch.compile``-wrapped model is unwrapped.
        directory (str | os.PathLike): the output directory, created if missing.
        config (QuantConfig | ModuleConfigs | None): the config that produced the weights, recorded in
            config.json and the checkpoint header; default None.
        max_shard_bytes (int | None): shard ``model.safetensors`` past this many bytes; default None (one file).
            Keyword-only.

    Returns:
        SaveSummary: the files written (config.json first), the tensors stored, and notes on which Linear modules
            stayed in float and which aliases were stored once.

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel`` (use ``save_quantized`` for other modules).

    Example:
        ```python
        import torchqkit as qk
        config = qk.Int4WeightOnlyConfig(group_size=128)
        qk.quantize_(model, config)
        print(qk.save_pretrained(model, "out/", config=config))   # out/config.json + out/model.safetensors
        ```
    """
    model = getattr(model, "_orig_mod", model)
    if not hasattr(model, "config") or not hasattr(model.config, "save_pretrained"):
        raise TypeError(f"save_pretrained takes a transformers PreTrainedModel, got {type(model).__name__}; "
                        f"use torchqkit.save_quantized for other modules")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    summary = save_quantized(model, directory / "model.safetensors", max_shard_bytes=max_shard_bytes, config=config)
    hf_config = copy.deepcopy(model.config)
    hf_config.architectures = [type(model).__name__]  # what from_pretrained rebuilds (transformers does the same)
    hf_config.quantization_config = quantization_record(model, config, summary.tied)
    kept = hf_config.quantization_config["modules_not_to_convert"]
    # transformers' own writer truncates config.json in place; an atomic write keeps a failed save loadable.
    atomic_write_bytes(directory / "config.json", hf_config.to_json_string(use_diff=True).encode())
    summary.files.insert(0, directory / "config.json")
    summary.notes += [f"Linear {n} left in float (modules_not_to_convert)" for n in kept]
    return summary


def quantization_record(model: nn.Module, config, tied: dict[str, str]) -> dict:
    """config.json's ``quantization_config`` for a quantized model (see the module docstring)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    quantized = [n for n, m in modules.items() if isinstance(getattr(m, "weight", None), AffineQuantizedTensor)]
    kept = [n for n, m in modules.items() if isinstance(m, nn.Linear) and n not in quantized]
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "torchqkit_version": torchqkit_version(),
            "config": encode_config(config), "quantized": quantized, "modules_not_to_convert": kept,
            "tied": dict(tied)}


def from_pretrained(directory, *, progress: bool | None = None) -> nn.Module:
    """Rebuild a model saved by ``torchqkit.save_pretrained``, or import a GPTQ / AWQ / compressed-tensors
    checkpoint, quantized weights and all, in one call.

    The transformers class named in config.json's ``architectures`` is built on the meta device, its
    non-persistent buffers (rotary frequencies, position ids) are computed by the model's own initializer, and
    ``load_quantized`` fills every saved tensor, so no float weight of a quantized layer is built. config.json and
    its ``quantization_config`` are validated the same way transformers' loader (through the torchqkit quantizer)
    validates them. A checkpoint whose quant_method is ``"gptq"``, ``"awq"`` or ``"compressed-tensors"`` (a Hub
    model quantized by AutoGPTQ / GPTQModel, AutoAWQ or llm-compressor) is imported instead: each quantized
    Linear's codes and scales go into a torchqkit layout as they are (2 / 4-bit into ``PackedIntxLayout``, int8
    into ``PlainLayout``, float8 into ``Float8Layout``, MXFP4 into ``MXLayout``), dequantizing bit for bit as the
    format defines, and the model gets a ``torchqkit_report`` saying what each Linear became (act-order GPTQ
    weights: see the report).

    Args:
        directory (str | os.PathLike): the directory ``save_pretrained`` wrote, or a GPTQ / AWQ /
            compressed-tensors checkpoint directory (config.json and model.safetensors or its shard index).
        progress (bool | None): a progress line on stderr, one step per tensor; default None: shown when
            stderr is a terminal.

    Returns:
        transformers.PreTrainedModel: the model, in eval mode.

    Raises:
        CheckpointError: an unreadable or invalid config.json, quantization_config or checkpoint (for an imported
            checkpoint: a tensor missing, of the wrong shape or dtype, packed bits or g_idx values that disagree
            with the config; the message names the file and tensor).
        ValueError: config.json has no torchqkit (or GPTQ / AWQ / compressed-tensors) ``quantization_config``, or
            its ``architectures`` names no transformers model class.

    Example:
        ```python
        import torchqkit as qk
        model = qk.from_pretrained("out/")
        logits = model(input_ids).logits
        ```
    """
    import transformers
    directory = Path(directory)
    qc = read_config_json(directory).get("quantization_config")  # see Note [One validation for both loaders]
    if isinstance(qc, dict) and qc.get("quant_method") in CHECKPOINT_IMPORTERS:
        return CHECKPOINT_IMPORTERS[qc["quant_method"]](directory, progress=progress)
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{directory}/config.json has no torchqkit quantization_config: it was not written by "
                         f"torchqkit.save_pretrained (float models load with transformers' from_pretrained)")
    check_quantization_config(qc, f"{directory / 'config.json'}: quantization_config")
    # trust_remote_code=False: a config.json with auto_map must never run code from the checkpoint.
    hf_config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False, local_files_only=True)
    archs = getattr(hf_config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"{directory}/config.json: architectures {archs} names no transformers model class")
    with torch.device("meta"):
        model = cls(hf_config)
    materialize_non_persistent_buffers(model)
    load_quantized(model, directory, progress=progress)
    return model.eval()


def read_quantization_config(directory) -> dict:
    """config.json's quantization_config, as save_pretrained wrote it."""
    return read_config_json(directory)["quantization_config"]


MAX_CONFIG_BYTES = 100 * 1024 * 1024  # as for a safetensors header


def read_config_json(directory) -> dict:
    """The JSON object in ``directory``/config.json, parsed strictly (CheckpointError naming the file otherwise)."""
    path = Path(directory) / "config.json"
    with open_regular_file(path, CheckpointError, "checkpoint's config.json") as f:  # the rule for every file read
        try:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise CheckpointError(f"{path}: can't read ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    data = parse_json(raw, str(path), CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return data


# Each field save_pretrained records, and the JSON types it may have (see the module docstring).
_RECORD_FIELDS = {"quant_method": (str,), "format_version": (int,), "torchqkit_version": (str,),
                  "config": (dict, type(None)), "quantized": (list,), "modules_not_to_convert": (list,),
                  "tied": (dict,), "strict": (bool,)}


def check_quantization_config(qc, where: str) -> dict:
    """Validate a ``quantization_config`` as recorded in config.json, for both loaders (Note [One validation for both
    loaders]); CheckpointError starting with ``where`` otherwise. Only quant_method is required (a
    ``quantization_config=`` dict for quantizing on load has little else). Returns ``qc``."""
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: must be a JSON object")
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{where}: quant_method must be {QUANT_METHOD!r}")
    if json_depth(qc) > MAX_JSON_DEPTH:
        raise CheckpointError(f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    unknown = sorted(k for k in qc if k not in _RECORD_FIELDS)
    if unknown:
        raise CheckpointError(f"{where}: unknown field {unknown[0]!r:.80} (known: {', '.join(_RECORD_FIELDS)}); a "
                              f"newer torchqkit may have written it: upgrade torchqkit")
    for key, kinds in _RECORD_FIELDS.items():
        # bool is an int in Python, not in JSON: a format_version of true is refused.
        if key in qc and (not isinstance(qc[key], kinds) or (bool not in kinds and isinstance(qc[key], bool))):
            raise CheckpointError(f"{where}: {key} must be {' or '.join(_JSON_NAMES[k] for k in kinds)}")
    if "format_version" in qc:
        check_format_version(qc["format_version"], where)
    for key in ("quantized", "modules_not_to_convert"):
        if not all(isinstance(n, str) for n in qc.get(key, [])):
            raise CheckpointError(f"{where}: {key} must be a list of module names (strings)")
    if not all(isinstance(v, str) for v in qc.get("tied", {}).values()):
        raise CheckpointError(f"{where}: tied must map tensor names to tensor names (strings)")
    decode_config(where, qc.get("config"))
    return qc


_JSON_NAMES = {str: "a string", int: "an integer", dict: "an object", list: "a list", bool: "true or false",
               type(None): "null"}


def check_format_version(version, where: str) -> None:
    """A recorded format version: a positive int this torchqkit reads (else: upgrade)."""
    if type(version) is not int or version < 1:
        raise CheckpointError(f"{where}: format_version must be a positive integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{where}: format_version {version}; this torchqkit ({torchqkit_version()}) reads "
                              f"formats up to {FORMAT_VERSION}: upgrade torchqkit")


def materialize_non_persistent_buffers(model: nn.Module) -> None:
    """Non-persistent buffers are not in any checkpoint: allocate them on CPU and let the model's own
    ``_init_weights`` compute them, only for modules without parameters of their own (so nothing loaded later
    is touched, and no float weight is ever built)."""
    modules = {}
    for name, buf in model.named_non_persistent_buffers():
        if not buf.is_meta:
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"non-persistent buffer {name} lives in a module with parameters; torchqkit can't "
                             f"recompute it without initializing those parameters")
        module._buffers[attr] = torch.empty_like(buf, device="cpu")
        modules[module_name] = module
    for module in modules.values():
        model._init_weights(module)
