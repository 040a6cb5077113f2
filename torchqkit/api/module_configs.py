"""ModuleConfigs: per-module configs for mixed precision.

Keys, in order of precedence:
  exact module name ("layers.0.attn.q_proj")
  "re:<pattern>"   regular expression that must match the whole name; the first matching key wins
  "_default"       everything else
A value of None leaves the module as it is. Built from a dict (configs or their dicts) or a JSON file.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .configs.base import QuantConfig, config_from_dict

__all__ = ["ModuleConfigs"]

DEFAULT_KEY = "_default"
REGEX_PREFIX = "re:"


class ModuleConfigs:
    def __init__(self, configs: dict):
        if not isinstance(configs, dict):
            raise TypeError(f"ModuleConfigs takes a dict of module name -> config, got {type(configs).__name__}")
        self.configs: dict[str, QuantConfig | None] = {}
        self._patterns: list[tuple[str, re.Pattern]] = []
        for key, value in configs.items():
            if not isinstance(key, str):
                raise TypeError(f"ModuleConfigs key {key!r} must be a string")
            if isinstance(value, dict):
                value = config_from_dict(value)
            if value is not None and not isinstance(value, QuantConfig):
                raise TypeError(f"ModuleConfigs[{key!r}] must be a config or None, got {type(value).__name__}")
            if key.startswith(REGEX_PREFIX):
                try:
                    self._patterns.append((key, re.compile(key[len(REGEX_PREFIX):])))
                except re.error as e:
                    raise ValueError(f"ModuleConfigs key {key!r} is not a valid regular expression: {e}") from None
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

    def exact_keys(self) -> list[str]:
        return [k for k in self.configs if k != DEFAULT_KEY and not k.startswith(REGEX_PREFIX)]

    def to_dict(self) -> dict:
        return {k: (None if v is None else v.to_dict()) for k, v in self.configs.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "ModuleConfigs":
        return cls(d)

    def to_json(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path) -> "ModuleConfigs":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls(data)

    def __eq__(self, other):
        return isinstance(other, ModuleConfigs) and self.configs == other.configs

    def __repr__(self) -> str:
        return f"ModuleConfigs({self.configs!r})"
