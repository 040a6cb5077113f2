"""Hugging Face transformers models: save_pretrained / from_pretrained for quantized models.

    qk.quantize_(model, configs)                       # any transformers PreTrainedModel
    qk.save_pretrained(model, "out/", config=configs)  # out/config.json + out/model.safetensors
    model = qk.from_pretrained("out/")                 # one call: skeleton on meta, packed weights, ready to run

config.json is the model's own, plus ``"quantization_config"``: {"quant_method": "torchqkit", "format_version",
"torchqkit_version", "config" (the producing config, as in the checkpoint header), "quantized" (modules whose
weight is quantized), "modules_not_to_convert" (Linear modules left in float), "tied" (aliases stored once)}.
transformers' own from_pretrained does not know "torchqkit" as a quant_method and says so; use
torchqkit.from_pretrained.

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
from .serialization.save_load import (FORMAT_VERSION, SaveSummary, encode_config, load_quantized, save_quantized,
                                      torchqkit_version)
from .files.open_checked import open_regular_file
from .files.strict_json import parse_json
from .tensor.affine_quantized_tensor import AffineQuantizedTensor

__all__ = ["save_pretrained", "from_pretrained", "quantization_record", "QUANT_METHOD"]

QUANT_METHOD = "torchqkit"


def save_pretrained(model: nn.Module, directory, config=None, *, max_shard_bytes: int | None = None) -> SaveSummary:
    """Write a (quantized) transformers model to ``directory``: config.json recording the quantization, and
    model.safetensors (shards + index past ``max_shard_bytes``). Returns the SaveSummary, whose notes say which
    Linear modules stayed in float and which aliases were stored once."""
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


def from_pretrained(directory) -> nn.Module:
    """Rebuild a model saved by torchqkit.save_pretrained: the class named in config.json's ``architectures``
    is built on the meta device, its non-persistent buffers (rotary frequencies, position ids) are computed by
    the model's own initializer, and load_quantized fills every saved tensor. Returns the model in eval mode."""
    import transformers
    directory = Path(directory)
    config_file = directory / "config.json"
    read_config_json(config_file)  # torchqkit's rules first: a regular file, strict JSON (transformers' parse recurses)
    # trust_remote_code=False: a config.json with auto_map must never run code from the checkpoint.
    hf_config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False, local_files_only=True)
    qc = getattr(hf_config, "quantization_config", None)
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{directory}/config.json has no torchqkit quantization_config: it was not written by "
                         f"torchqkit.save_pretrained (float models load with transformers' from_pretrained)")
    archs = getattr(hf_config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"{directory}/config.json: architectures {archs} names no transformers model class")
    with torch.device("meta"):
        model = cls(hf_config)
    materialize_non_persistent_buffers(model)
    load_quantized(model, directory)
    return model.eval()


def read_config_json(path) -> dict:
    """A checkpoint's config.json read by torchqkit's rules (files/open_checked.py, files/strict_json.py): a regular
    file named directly, strict JSON nested at most MAX_JSON_DEPTH deep, a JSON object; ValueError naming the file."""
    with open_regular_file(path, ValueError, "config.json") as f:
        data = parse_json(f.read(), str(path))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object, not a {type(data).__name__}")
    return data


def read_quantization_config(directory) -> dict:
    """config.json's quantization_config, as save_pretrained wrote it."""
    path = Path(directory) / "config.json"
    return read_config_json(path)["quantization_config"]


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
