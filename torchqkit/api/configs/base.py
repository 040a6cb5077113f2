"""QuantConfig base, the handler registry, and the JSON codec configs round-trip through.

Configs are frozen, keyword-only dataclasses. ``to_dict`` / ``from_dict`` turn them into JSON-able
dicts: nested objects (granularity, layout) become ``{"type": name, ...fields}``, qdtypes their
name, enums their value, tuples lists. Only allowlisted types are rebuilt; anything else is a TypeError.
"""
from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Callable

from ...core import granularity as _granularity
from ...core.qdtype import QDType, qdtype_from_name
from ...layouts.base import Layout, layout_class
from ...tensor.activation import KernelPreference

__all__ = ["QuantConfig", "register_config", "handler_for", "known_configs", "config_from_dict"]

_CONFIGS: dict[str, type["QuantConfig"]] = {}
_HANDLERS: dict[type, Callable] = {}
_GRANULARITIES = {c.__name__: c for c in (_granularity.PerTensor, _granularity.PerAxis, _granularity.PerGroup,
                                          _granularity.PerRow, _granularity.PerToken, _granularity.PerBlock)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    kernel_preference: KernelPreference = KernelPreference.AUTO

    def __post_init__(self):
        object.__setattr__(self, "kernel_preference", KernelPreference(self.kernel_preference))

    def to_dict(self) -> dict:
        return _encode(self)

    @staticmethod
    def from_dict(d: dict) -> "QuantConfig":
        return config_from_dict(d)

    def describe(self) -> str:
        """Short human text for reports and extra_repr."""
        return repr(self)


def register_config(handler: Callable):
    """Class decorator: register a config class with its handler ``handler(config, weight, name) -> AQT``."""
    def deco(cls):
        _CONFIGS[cls.__name__] = cls
        _HANDLERS[cls] = handler
        return cls
    return deco


def handler_for(config) -> Callable:
    try:
        return _HANDLERS[type(config)]
    except KeyError:
        raise TypeError(f"No handler for {type(config).__name__}; known configs: {known_configs()}") from None


def known_configs() -> list[str]:
    return sorted(_CONFIGS)


def config_from_dict(d: dict) -> QuantConfig:
    if not isinstance(d, dict) or d.get("type") not in _CONFIGS:
        got = d.get("type") if isinstance(d, dict) else type(d).__name__
        raise TypeError(f"unknown config type {got!r}; known configs: {known_configs()}")
    return _decode(d)


# ---------------------------------------------------------------------------------------- codec

def _encode(obj):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, QDType):
        return obj.name
    if isinstance(obj, (tuple, list)):
        return [_encode(v) for v in obj]
    if isinstance(obj, Layout):
        return {k: _encode(v) for k, v in obj.to_dict().items()}
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in {**_CONFIGS, **_GRANULARITIES}:
        return {"type": type(obj).__name__,
                **{f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    raise TypeError(f"can't encode {obj!r} ({type(obj).__name__}) into a config dict")


def _decode(obj):
    if isinstance(obj, list):
        return tuple(_decode(v) for v in obj)
    if not isinstance(obj, dict):
        return obj
    fields = {k: _decode(v) for k, v in obj.items() if k != "type"}
    kind = obj.get("type")
    if kind in _CONFIGS:
        cls = _CONFIGS[kind]
    elif kind in _GRANULARITIES:
        cls = _GRANULARITIES[kind]
    else:
        try:
            return layout_class(kind)(**fields)
        except ValueError:
            known = sorted({*_CONFIGS, *_GRANULARITIES})
            raise TypeError(f"unknown type {kind!r} in config dict; known types: {known} and layout names") from None
    try:
        return cls(**fields)
    except TypeError as e:
        raise TypeError(f"bad fields for {kind}: {e}") from None


def as_qdtype(value) -> QDType:
    return value if isinstance(value, QDType) else qdtype_from_name(value)
