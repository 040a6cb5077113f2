"""QuantConfig base, the handler registry, and the JSON codec configs round-trip through.

Configs are frozen, keyword-only dataclasses. ``to_dict`` / ``from_dict`` turn them into JSON-able
dicts: nested objects (granularity, layout) become ``{"type": name, ...fields}``, qdtypes their
name, enums their value, tuples lists. Only allowlisted types are rebuilt; anything else is a TypeError.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
import re
import types
import typing
from enum import Enum
from typing import Callable

from ...core import granularity as _granularity
from ...core.qdtype import QDType, qdtype_from_name
from ...layouts.base import Layout, layout_class
from ...tensor.activation import KernelPreference

__all__ = ["QuantConfig", "register_config", "register_recipe_config", "handler_for", "recipe_for", "known_configs",
           "config_from_dict", "check_fields"]

_CONFIGS: dict[str, type["QuantConfig"]] = {}
_HANDLERS: dict[type, Callable] = {}
_RECIPES: dict[type, Callable] = {}
_GRANULARITIES = {c.__name__: c for c in (_granularity.PerTensor, _granularity.PerAxis, _granularity.PerGroup,
                                          _granularity.PerRow, _granularity.PerToken, _granularity.PerBlock)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Base class of every quantization config: a frozen, keyword-only dataclass that ``quantize_`` dispatches on.

    Each concrete config (``Int4WeightOnlyConfig``, ``GPTQConfig``, ...) is registered with the handler that turns
    one float weight into one quantized weight. Every field is checked against its annotation when the config is
    built (or decoded from JSON), so a bad value fails then, naming the config and the field. ``to_dict()`` /
    ``from_dict()`` round-trip a config through JSON-able dicts; ``describe()`` gives the short text reports show;
    ``needs_calibration_data()`` says whether ``quantize_`` must be given ``calibration_data=``.

    Args:
        kernel_preference (KernelPreference): which implementation serves the quantized ops: ``AUTO`` (default),
            ``REFERENCE``, ``TRITON`` or ``CUDA``, or their values (``"auto"``, ...).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a field value out of its range (a size below 1, a scale <= 0, a value not in a Literal).

    Example:
        ```python
        import torchqkit as qk
        config = qk.Int4WeightOnlyConfig(group_size=64)
        assert isinstance(config, qk.QuantConfig)
        d = config.to_dict()            # {"type": "Int4WeightOnlyConfig", "group_size": 64, ...}
        assert qk.QuantConfig.from_dict(d) == config
        print(config.describe(), config.needs_calibration_data())
        ```
    """
    kernel_preference: KernelPreference = KernelPreference.AUTO

    def __post_init__(self):
        check_fields(self)

    def to_dict(self) -> dict:
        return _encode(self)

    @staticmethod
    def from_dict(d: dict) -> "QuantConfig":
        return config_from_dict(d)

    def describe(self) -> str:
        """Short human text for reports and extra_repr."""
        return repr(self)

    def needs_calibration_data(self) -> bool:
        """True when quantize_ must be given calibration_data= for this config (GPTQ, AWQ, SmoothQuant,
        static activation scales left to calibration)."""
        return False


def register_config(handler: Callable):
    """Class decorator: register a config class with its handler ``handler(config, weight, name) -> AQT``."""
    def deco(cls):
        _CONFIGS[cls.__name__] = cls
        _HANDLERS[cls] = handler
        return cls
    return deco


def register_recipe_config(recipe: Callable):
    """Class decorator for a config that quantizes every weight the same way: ``recipe(config) -> WeightRecipe``.
    Its handler is ``recipe(config).quantize(weight, name)``, and ``recipe_for`` lets training fake-quantize
    with exactly that recipe. Configs whose result depends on more than the weight (calibration data) use
    ``register_config`` with their own handler."""
    def handler(config, weight, name):
        return recipe(config).quantize(weight, name)

    def deco(cls):
        _RECIPES[cls] = recipe
        return register_config(handler)(cls)
    return deco


def recipe_for(config):
    """The WeightRecipe a config quantizes every weight with; TypeError when it has none (its handler needs
    more than the weight, or it isn't a config)."""
    handler_for(config)  # unknown types: the error listing the known configs
    try:
        return _RECIPES[type(config)](config)
    except KeyError:
        with_recipe = sorted(c.__name__ for c in _RECIPES)
        raise TypeError(f"{type(config).__name__} has no per-weight recipe (its handler needs more than the weight), "
                        f"so it can't be emulated weight by weight; configs with one: {with_recipe}") from None


def handler_for(config) -> Callable:
    try:
        return _HANDLERS[type(config)]
    except KeyError:
        raise TypeError(f"No handler for {type(config).__name__}; known configs: {known_configs()}") from None


def known_configs() -> list[str]:
    """The names of every registered config class, sorted.

    These are the ``"type"`` values ``config_from_dict`` accepts (and that error messages list).

    Returns:
        list[str]: the config class names, e.g. ``["AWQConfig", "Float8DynamicActivationFloat8WeightConfig", ...]``.

    Example:
        ```python
        import torchqkit as qk
        assert "Int4WeightOnlyConfig" in qk.known_configs()
        ```
    """
    return sorted(_CONFIGS)


def config_from_dict(d: dict) -> QuantConfig:
    """Rebuild a config from the dict ``QuantConfig.to_dict()`` made (e.g. read back from JSON).

    Nested objects are decoded too: granularities and layouts from ``{"type": name, ...fields}``, qdtypes from
    their names, enums from their values, lists to tuples. Only registered configs, granularities and layouts are
    rebuilt, and every field is checked as when the config is built directly.

    Args:
        d (dict): a config dict with a ``"type"`` key naming a registered config (see ``known_configs()``) and the
            config's fields.

    Returns:
        QuantConfig: a new config equal to the one encoded.

    Raises:
        TypeError: ``d`` is not a dict, its ``"type"`` (or a nested object's) is unknown, or its fields don't fit
            the config.
        ValueError: a field value the config refuses.

    Example:
        ```python
        import json
        import torchqkit as qk
        text = json.dumps(qk.Int4WeightOnlyConfig(group_size=32).to_dict())
        config = qk.config_from_dict(json.loads(text))
        assert config == qk.Int4WeightOnlyConfig(group_size=32)
        ```
    """
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


# ---------------------------------------------------------------------------------------- field checks

# Note [Config field checks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# QuantConfig.__post_init__ checks every field of every config against its annotation, so a bad value fails
# when the config is built (or decoded from JSON), naming the config, the field and what it takes, instead of
# at quantize time, or never (group_size=True used to mean per-element groups). A config subclass gets this
# by calling super().__post_init__() first; it only adds rules specific to it (Int4's group sizes, ...).
#   int     an int (anything with __index__), not a bool, not a float or a string. A size (a name ending in
#           "size", "bits", "tiles", or starting with "num_" / "n_") must be >= 1.
#   float   a real number, not a bool, finite. A scale (a name ending in "scale") must be > 0.
#   bool    True or False only.        str / Literal[...]: a string / one of the listed values.
#   Enum    a member or its value (converted to the member).
#   QDType  a QDType or its name ("int8"; converted).
#   Layout  a Layout instance, or a registered layout's name (converted: layout="plain" is PlainLayout()).
#   other classes (Granularity, ...): an instance.   X | None: None, or an X.   tuple[X, ...]: each an X.
# A field overrides or adds bounds in its metadata: field(default=..., metadata={"ge": 0, "le": 8, "gt": 0.0}).
_SIZE_NAME = re.compile(r"(.*_)?(size|bits|tiles)|(num|n)_.+")
_SCALE_NAME = re.compile(r"(.*_)?scale")


def check_fields(config) -> None:
    """Check (and normalize: enum values, qdtype and layout names) every field of a config dataclass."""
    who = type(config).__name__
    for f, hint in _field_hints(type(config)):
        what = f"{who}: {f.name}"
        value = _check_value(getattr(config, f.name), hint, what)
        _check_bounds(value, _bounds(f), what, optional=type(None) in typing.get_args(hint))
        object.__setattr__(config, f.name, value)


@functools.lru_cache(maxsize=None)
def _field_hints(cls) -> tuple:
    try:
        hints = typing.get_type_hints(cls)  # string annotations (from __future__) resolved in each class's module
    except NameError as e:
        raise TypeError(f"{cls.__name__}: a field annotation names a type its module doesn't import at run time "
                        f"({e}); config fields are checked against their annotations") from None
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def _bounds(f: dataclasses.Field) -> dict:
    bounds = {}
    if _SIZE_NAME.fullmatch(f.name):
        bounds["ge"] = 1
    if _SCALE_NAME.fullmatch(f.name):
        bounds["gt"] = 0
    bounds.update({k: v for k, v in f.metadata.items() if k in ("ge", "gt", "le")})
    return bounds


def _check_bounds(value, bounds: dict, what: str, optional: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    for key, limit, ok in (("ge", ">=", lambda a, b: a >= b), ("gt", ">", lambda a, b: a > b),
                           ("le", "<=", lambda a, b: a <= b)):
        if key in bounds and not ok(value, bounds[key]):
            raise ValueError(f"{what} must be {limit} {bounds[key]}{' (or None)' if optional else ''}, got {value!r}")


def _check_value(value, hint, what: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _check_value(value, option, what)
            except (TypeError, ValueError) as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise TypeError(f"{what} must be {' or '.join(_type_text(o) for o in args)}, got {_short(value)}")
    if origin is typing.Literal:
        if not any(type(value) is type(a) and value == a for a in args):  # True is not 1 here
            raise ValueError(f"{what} must be one of {list(args)}, got {_short(value)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{what} must be a sequence, got {_short(value)}")
        inner = args[0] if args else typing.Any
        return tuple(_check_value(v, inner, f"{what}[{i}]") for i, v in enumerate(value))
    if hint is typing.Any or not isinstance(hint, type):
        return value  # e.g. Callable: nothing to check against
    return _check_class(value, hint, what)


def _check_class(value, cls: type, what: str):
    if cls is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{what} must be True or False, got {_short(value)}")
        return value
    if cls is int:
        if isinstance(value, (bool, float, str)) or not hasattr(value, "__index__"):
            raise TypeError(f"{what} must be an int, got {_short(value)}")
        return operator.index(value)
    if cls is float:
        if isinstance(value, (bool, str)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{what} must be a number, got {_short(value)}")
        if not math.isfinite(value):
            raise ValueError(f"{what} must be finite, got {value!r}")
        return float(value)
    if issubclass(cls, Enum):
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {[m.value for m in cls]}, got {_short(value)}") from None
    if cls is QDType and isinstance(value, str):
        return qdtype_from_name(value)  # ValueError listing the known names
    if cls is Layout and isinstance(value, str):
        try:
            return layout_class(value)()
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    if not isinstance(value, cls):
        hint = " or a layout name" if cls is Layout else " or its name" if cls is QDType else ""
        raise TypeError(f"{what} must be a {cls.__name__}{hint}, got {_short(value)}")
    return value


def _type_text(t) -> str:
    return "None" if t is type(None) else getattr(t, "__name__", str(t))


def _short(value) -> str:
    return f"{value!r:.60} ({type(value).__name__})"
