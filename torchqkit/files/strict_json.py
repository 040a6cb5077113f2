"""JSON from files torchqkit reads (checkpoint headers, shard indexes, config files), parsed strictly.

Python's json accepts what the JSON standard doesn't (NaN, Infinity, duplicate keys: the last one silently
wins) and fails in ways a loader shouldn't pass on: RecursionError on deep nesting (json.loads recurses in C;
and the config decoder recurses again afterwards), UnicodeDecodeError quoting the offending byte. ``parse_json``
turns every one of these into one error of the caller's type that names the source and never quotes its bytes.
"""
from __future__ import annotations

import json

__all__ = ["parse_json", "json_depth", "MAX_JSON_DEPTH"]

# Deeper than anything torchqkit writes (a ModuleConfigs file: keys -> config -> granularity -> block_size is 4).
MAX_JSON_DEPTH = 32


def parse_json(data: bytes | str, where: str, error: type[Exception] = ValueError, *,
               max_depth: int = MAX_JSON_DEPTH):
    """The value of the JSON text ``data``; any problem raises ``error(f"{where}: ...")``."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where}: not UTF-8 text (invalid byte at offset {e.start})") from None
    try:
        value = json.loads(data, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply (more than {max_depth} levels)") from None
    except _StrictJSONError as e:
        raise error(f"{where}: {e}") from None
    if json_depth(value) > max_depth:
        raise error(f"{where}: JSON nested too deeply (more than {max_depth} levels)")
    return value


class _StrictJSONError(ValueError):
    pass


def _reject_constant(name: str):
    raise _StrictJSONError(f"not standard JSON: {name} is not a JSON number")


def _unique_keys(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _StrictJSONError("an object has the same key twice (which one counts is undefined)")
    return out


def json_depth(value) -> int:
    """Nesting depth of the containers of a parsed JSON value, without recursion (it may be ~1000 levels deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest
