"""ModuleConfigs: per-module configs for mixed precision.

Keys, in order of precedence:
  exact module name ("layers.0.attn.q_proj")
  "re:<pattern>"   regular expression that must match the whole name; the first matching key wins. Patterns
                   whose matching time can't be bounded are refused: see Note [Bounded name patterns]
                   in name_patterns.py
  "_default"       everything else
A value of None leaves the module as it is. Built from a dict (configs or their dicts) or a JSON file.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..files import atomic_write_bytes, open_regular_file, parse_json
from .configs.base import QuantConfig, config_from_dict
from .name_patterns import NamePattern

__all__ = ["ModuleConfigs"]

DEFAULT_KEY = "_default"
REGEX_PREFIX = "re:"


class ModuleConfigs:
    """Per-module configs for mixed precision: which config (or none) each module of a model gets.

    Keys, in order of precedence: an exact module name (``"layers.0.attn.q_proj"``); ``"re:<pattern>"``, a
    regular expression that must match the whole name (the first matching key wins; patterns whose matching time
    can't be bounded are refused); and ``"_default"`` for everything else. A value of None leaves the module in
    float. A module named exactly is quantized even if ``quantize_``'s ``filter_fn`` would not select it.
    ``to_dict()`` / ``from_dict()`` and ``to_json(path)`` / ``from_json(path)`` round-trip it; ``lookup(fqn)``
    returns the (key, config) a module gets.

    Args:
        configs (dict[str, QuantConfig | dict | None]): module name or pattern -> a config, a config dict (as
            ``QuantConfig.to_dict()`` makes; decoded), or None.

    Raises:
        TypeError: ``configs`` is not a dict, a key is not a string, or a value is not a config, config dict or
            None.
        ValueError: a ``"re:"`` pattern that is not a valid regular expression or can't be matched in bounded time,
            or an invalid config dict.

    Example:
        ```python
        import torchqkit as qk
        configs = qk.ModuleConfigs({
            "lm_head": None,                                       # stays float
            "re:.*mlp.*": qk.Int4WeightOnlyConfig(group_size=64),
            "_default": qk.Int8WeightOnlyConfig(),
        })
        report = qk.quantize_(model, configs)
        configs.to_json("quant_config.json")
        ```
    """
    def __init__(self, configs: dict):
        if not isinstance(configs, dict):
            raise TypeError(f"ModuleConfigs takes a dict of module name -> config, got {type(configs).__name__}")
        self.configs: dict[str, QuantConfig | None] = {}
        self._patterns: list[tuple[str, NamePattern]] = []
        for key, value in configs.items():
            if not isinstance(key, str):
                raise TypeError(f"ModuleConfigs key {key!r} must be a string")
            if isinstance(value, dict):
                value = config_from_dict(value)
            if value is not None and not isinstance(value, QuantConfig):
                raise TypeError(f"ModuleConfigs[{key!r}] must be a config or None, got {type(value).__name__}")
            if key.startswith(REGEX_PREFIX):
                self._patterns.append((key, NamePattern(key[len(REGEX_PREFIX):], f"ModuleConfigs key {key!r}")))
            self.configs[key] = value

    def lookup(self, fqn: str) -> tuple[str | None, QuantConfig | None]:
        """(matching key, config) for a module name; (None, None) when nothing matches."""
        if fqn in self.configs:
            return fqn, self.configs[fqn]
        for key, pattern in self._patterns:
            if pattern.fullmatch(fqn):
                return key, self.configs[key]
        if DEFAULT_KEY in self.configs:
            return DEFAULT_KEY, self.configs[DEFAULT_KEY]
        return None, None

    def check_patterns(self, fqns) -> None:
        """Raise before any work if a "re:" key can't be matched against one of ``fqns`` in bounded time (a very
        long module name); see Note [Bounded name patterns] in name_patterns.py."""
        for fqn in fqns:
            for _, pattern in self._patterns:
                pattern.check_bounded(fqn)

    def exact_keys(self) -> list[str]:
        return [k for k in self.configs if k != DEFAULT_KEY and not k.startswith(REGEX_PREFIX)]

    def unmatched(self, fqns) -> list[str]:
        """The "re:" keys that select none of the module names ``fqns``: their pattern matches none of them, or
        only names an exact key or an earlier pattern takes first. Such a key does nothing (a typo, a renamed
        module); quantize_ and quantize_checkpoint report each one instead of skipping it silently."""
        fqns = list(fqns)
        chosen = {self.lookup(fqn)[0] for fqn in fqns}
        return [key for key, _ in self._patterns if key not in chosen]

    def describe(self) -> str:
        """One line for reports and CLIs: each key and its config's description, None as "float"."""
        return "; ".join(f"{key}: {'float' if value is None else value.describe()}"
                         for key, value in self.configs.items())

    def to_dict(self) -> dict:
        return {k: (None if v is None else v.to_dict()) for k, v in self.configs.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "ModuleConfigs":
        return cls(d)

    def to_json(self, path) -> None:
        """Write the configs as JSON; the file is replaced atomically (never left half-written)."""
        atomic_write_bytes(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())

    @classmethod
    def from_json(cls, path) -> "ModuleConfigs":
        """Read a file written by ``to_json``. Bad files raise ValueError naming the file (not JSON, not UTF-8,
        nested too deeply, an invalid config); never RecursionError or UnicodeDecodeError."""
        path = Path(path)
        with open_regular_file(path, ValueError, "config file") as f:
            data = parse_json(f.read(), str(path))
        try:
            return cls(data)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{path}: {e}") from None

    def __eq__(self, other):
        return isinstance(other, ModuleConfigs) and self.configs == other.configs

    def __repr__(self) -> str:
        return f"ModuleConfigs({self.configs!r})"
