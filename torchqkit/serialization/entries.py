"""The JSON entry that describes one quantized weight in a torchqkit safetensors file, and its validation.

See Note [torchqkit safetensors format] in save_load.py. An entry:

    {"layout": {"type": "tensor_core_tiled", "inner_k_tiles": 8},   # Layout.to_dict(): name + knobs
     "qdtype": "uint4", "block_size": [1, 128], "shape": [N, K],    # logical (untransposed) shape
     "dtype": "bfloat16",                                           # outer dtype, dequantize() returns it
     "zero_point_domain": "float", "transposed": false, "kernel_preference": "auto",
     "act_quant": null | {"qdtype": "int8", "granularity": {"type": "PerToken"}, "mapping": "symmetric",
                          "static_scale": null},                   # or {"type": "PerGroup", "group_size": 32}
     "tensors": ["qdata", "scale_and_zero"]}                        # inner tensors stored as "<name>:<inner>"

``decode_entry`` turns it back into constructor arguments, checking every field against the registries
(layouts, qdtypes, enums); ``check_tensors`` checks the stored tensors against ``Layout.packed_specs``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import torch

from ..core import granularity as _granularity
from ..core.granularity import validate_block_size
from ..core.primitives import MappingType, ZeroPointDomain
from ..core.qdtype import qdtype_from_name
from ..layouts.base import FLOAT_DTYPES, PackedSpec, WeightFormat, layout_class
from ..tensor.activation import ActivationQuantSpec, KernelPreference
from ..tensor.affine_quantized_tensor import INPUT_SCALE, AffineQuantizedTensor
from .safetensors_file import CheckpointError

__all__ = ["INNER_SEP", "encode_entry", "decode_entry", "check_tensors", "ORIG_DTYPES"]

INNER_SEP = ":"  # "layers.0.mlp.up_proj.weight:qdata"; ":" never occurs in a module path
ORIG_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ORIG_DTYPE_NAMES = {v: k for k, v in ORIG_DTYPES.items()}
_GRANULARITIES = {c.__name__: c for c in (_granularity.PerTensor, _granularity.PerRow, _granularity.PerToken,
                                           _granularity.PerGroup)}
_ENTRY_KEYS = {"layout", "qdtype", "block_size", "shape", "dtype", "zero_point_domain", "transposed",
               "kernel_preference", "act_quant", "tensors"}


def encode_entry(w: AffineQuantizedTensor) -> dict:
    if w.orig_dtype not in _ORIG_DTYPE_NAMES:
        raise ValueError(f"quantized weight of dtype {w.orig_dtype}: files store {sorted(ORIG_DTYPES)} weights")
    act = w.act_quant
    return {
        "layout": w.qlayout.to_dict(), "qdtype": w.qdtype.name, "block_size": list(w.block_size),
        "shape": list(w.logical_shape), "dtype": _ORIG_DTYPE_NAMES[w.orig_dtype],
        "zero_point_domain": w.zero_point_domain.value, "transposed": w.transposed,
        "kernel_preference": w.kernel_preference.value,
        "act_quant": None if act is None else {
            "qdtype": act.qdtype.name, "granularity": _encode_act_granularity(act),
            "mapping": act.mapping.value, "static_scale": act.static_scale},
        "tensors": [n for n, t in w.inner_tensors().items() if t is not None],
    }


def decode_entry(entry) -> dict:
    """Entry -> keyword arguments of AffineQuantizedTensor (without ``tensors``). Raises ValueError
    saying which field is wrong; the caller adds the tensor name."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"entry must have the fields {sorted(_ENTRY_KEYS)}, got {got}")
    shape, block_size = _int_list(entry, "shape"), _int_list(entry, "block_size")
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ValueError(f"shape must be 2 positive ints (out_features, in_features), or 3 for a stack of experts "
                         f"(experts, out_features, in_features), got {shape}")
    reason = validate_block_size(shape, block_size)
    if reason is None and len(shape) == 3 and block_size[0] != 1:
        reason = "a stack of experts has one expert per block along dim 0 (block_size[0] == 1)"
    if reason is not None:
        raise ValueError(f"block_size {block_size} doesn't fit shape {shape}: {reason}")
    layout = _decode_layout(entry["layout"])
    qdtype = qdtype_from_name(_string(entry, "qdtype"))
    zpd = ZeroPointDomain(_string(entry, "zero_point_domain"))
    reason = layout.supports(WeightFormat.of(qdtype, block_size[-2:], shape[-2:], zpd))  # each expert's format
    if reason is not None:
        raise ValueError(f"layout can't hold this weight: {reason}")
    if _string(entry, "dtype") not in ORIG_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(ORIG_DTYPES)}, got {quote(entry['dtype'])}")
    if not isinstance(entry["transposed"], bool):
        raise ValueError(f"transposed must be true or false, got {quote(entry['transposed'])}")
    tensors = entry["tensors"]
    if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
        raise ValueError(f"tensors must be a list of names, got {quote(tensors)}")
    return dict(qdtype=qdtype, block_size=tuple(block_size), logical_shape=tuple(shape),
                orig_dtype=ORIG_DTYPES[entry["dtype"]], qlayout=layout, zero_point_domain=zpd,
                act_quant=_decode_act(entry["act_quant"]),
                kernel_preference=KernelPreference(_string(entry, "kernel_preference")),
                transposed=entry["transposed"])


def check_tensors(attrs: dict, stored: list[str], shapes: dict[str, tuple], dtypes: dict[str, torch.dtype]) -> None:
    """The stored inner tensors are exactly the ones the layout packs, with the shapes and dtypes it packs (plus
    an optional ``input_scale`` of in_features floats, see Note [Input scale] in tensor/affine_quantized_tensor.py)."""
    layout = attrs["qlayout"]
    shape, experts = attrs["logical_shape"], attrs["logical_shape"][:-2]  # (E,) for a stack of experts, else ()
    specs = layout.packed_specs(WeightFormat.of(attrs["qdtype"], attrs["block_size"][-2:], shape[-2:],
                                                attrs["zero_point_domain"]))
    # A stack of experts stores each expert's packed tensors with a leading expert dim (Note [Expert weights]).
    specs = {n: PackedSpec((*experts, *s.shape), s.dtypes) for n, s in specs.items()}
    if INPUT_SCALE in stored:
        specs = {**specs, INPUT_SCALE: PackedSpec((attrs["logical_shape"][-1],), FLOAT_DTYPES)}
    if sorted(stored) != sorted(specs):
        raise ValueError(f"{layout!r} stores {sorted(specs)} for this weight, the entry lists {sorted(stored)}")
    for inner, spec in specs.items():
        if shapes[inner] != spec.shape:
            raise ValueError(f"{inner} has shape {list(shapes[inner])} but a {list(attrs['logical_shape'])} weight in "
                             f"{layout!r} needs {list(spec.shape)}: the header's shape doesn't match the data")
        if dtypes[inner] not in spec.dtypes:
            raise ValueError(f"{inner} has dtype {dtypes[inner]}, {layout!r} stores it as one of "
                             f"{[str(d) for d in spec.dtypes]}")


def _decode_layout(d):
    if not isinstance(d, dict) or not isinstance(d.get("type"), str):
        raise ValueError(f"layout must be an object with a 'type' name, got {quote(d)}")
    knobs = {k: v for k, v in d.items() if k != "type"}
    cls = layout_class(_string(d, "type"))  # ValueError naming the known layouts
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    for k, v in knobs.items():
        if k not in fields:
            raise ValueError(f"layout {d['type']!r} has no knob {quote(k)}; its knobs: {sorted(fields)}")
        if not isinstance(v, (bool, int)):  # every layout knob today is an int or a bool
            raise ValueError(f"layout {d['type']!r}: knob {k} must be an int or bool, got {quote(v)}")
    try:
        return cls(**knobs)
    except TypeError as e:
        raise ValueError(f"layout {d['type']!r}: {e}") from None


def _encode_act_granularity(act: ActivationQuantSpec) -> dict:
    g = {"type": type(act.granularity).__name__}
    return g if act.group_size is None else {**g, "group_size": act.group_size}


def _decode_act(d) -> ActivationQuantSpec | None:
    if d is None:
        return None
    if not isinstance(d, dict) or set(d) != {"qdtype", "granularity", "mapping", "static_scale"}:
        raise ValueError(f"act_quant must be null or have qdtype, granularity, mapping, static_scale; got {quote(d)}")
    g = d["granularity"]
    keys = {"type", "group_size"} if isinstance(g, dict) and g.get("type") == "PerGroup" else {"type"}
    kind = g.get("type") if isinstance(g, dict) and set(g) == keys else None
    if not isinstance(kind, str) or kind not in _GRANULARITIES:
        raise ValueError(f"act_quant granularity must be one of {sorted(_GRANULARITIES)} (PerGroup with its "
                         f"group_size), got {quote(g)}")
    size = g.get("group_size")
    if kind == "PerGroup" and (type(size) is not int or size < 1):
        raise ValueError(f"act_quant granularity PerGroup needs a positive int group_size, got {quote(g)}")
    static = d["static_scale"]
    if static is not None and (type(static) not in (int, float) or not math.isfinite(static) or not static > 0):
        raise ValueError(f"act_quant static_scale must be null or a finite positive number, got {quote(static)}")
    granularity = _GRANULARITIES[kind](size) if kind == "PerGroup" else _GRANULARITIES[kind]()
    return ActivationQuantSpec(qdtype_from_name(_string(d, "qdtype")), granularity,
                               MappingType(_string(d, "mapping")), None if static is None else float(static))


def _int_list(entry: dict, key: str) -> list[int]:
    v = entry[key]
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"{key} must be a list of ints, got {quote(v)}")
    return v


def _string(entry: dict, key: str) -> str:
    v = entry[key]
    if not isinstance(v, str) or not _NAME.fullmatch(v):
        raise ValueError(f"{key} must be a name, got {quote(v)}")
    return v


_NAME = re.compile(r"[\w.\-]{1,64}")


def quote(value) -> str:
    """A header value as an error message may show it: numbers, booleans and short names; anything else only by
    its JSON type, so a message never carries arbitrary bytes of the file."""
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    if isinstance(value, str) and _NAME.fullmatch(value):
        return repr(value)
    return f"a JSON {_JSON_TYPES.get(type(value), type(value).__name__)}"


_JSON_TYPES = {dict: "object", list: "array", str: "string"}


def entry_error(path, name: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: tensor {name!r}: {problem}")
