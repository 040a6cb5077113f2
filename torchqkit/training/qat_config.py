"""QATConfig: which quantization a model trains towards, and how gradients pass the fake quantizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..api.configs.base import QuantConfig, config_from_dict
from ..api.module_configs import ModuleConfigs

__all__ = ["QATConfig", "GRADIENT_RULES"]

# "ste": the straight-through estimator, d fake_quant(x) / dx = 1 everywhere.
# "clipped_ste": 1 where x lies inside the range the quantizer can represent (its calibrated range), 0 where it
#   was clipped to the first / last code, so no gradient pushes a saturated value further out.
GRADIENT_RULES = ("ste", "clipped_ste")


@dataclass(frozen=True)
class QATConfig:
    """Quantization-aware training towards ``base`` (any per-weight config, or a ModuleConfigs of them).

    grad: "ste" or "clipped_ste" (see GRADIENT_RULES).
    stochastic_rounding: round weights up or down at random in the training forward (integer formats only;
        unbiased in expectation). Conversion rounds to nearest, so it no longer matches the last forward exactly.
    seed: seeds the stochastic rounding streams (one torch.Generator per layer, seed + layer index)."""
    base: QuantConfig | ModuleConfigs
    grad: Literal["ste", "clipped_ste"] = "ste"
    stochastic_rounding: bool = False
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.base, (QuantConfig, ModuleConfigs)):
            raise TypeError(f"QATConfig: base must be a quantization config (e.g. Int4WeightOnlyConfig(group_size=32)) "
                            f"or a ModuleConfigs, got {type(self.base).__name__}")
        if self.grad not in GRADIENT_RULES:
            raise ValueError(f"QATConfig: grad must be one of {list(GRADIENT_RULES)}, got {self.grad!r}")
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"QATConfig: stochastic_rounding must be True or False, got {self.stochastic_rounding!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"QATConfig: seed must be an int, got {self.seed!r}")

    def to_dict(self) -> dict:
        base = ({"module_configs": self.base.to_dict()} if isinstance(self.base, ModuleConfigs)
                else self.base.to_dict())
        return {"type": "QATConfig", "base": base, "grad": self.grad,
                "stochastic_rounding": self.stochastic_rounding, "seed": self.seed}

    @staticmethod
    def from_dict(d: dict) -> "QATConfig":
        if not isinstance(d, dict) or d.get("type") != "QATConfig" or not isinstance(d.get("base"), dict):
            raise TypeError(f"QATConfig.from_dict takes a dict written by QATConfig.to_dict, got {d!r:.80}")
        base = d["base"]
        base = ModuleConfigs(base["module_configs"]) if "module_configs" in base else config_from_dict(base)
        extra = set(d) - {"type", "base", "grad", "stochastic_rounding", "seed"}
        if extra:
            raise TypeError(f"QATConfig.from_dict: unknown field(s) {sorted(extra)}")
        return QATConfig(base, grad=d.get("grad", "ste"), stochastic_rounding=d.get("stochastic_rounding", False),
                         seed=d.get("seed", 0))

    def describe(self) -> str:
        base = "ModuleConfigs" if isinstance(self.base, ModuleConfigs) else self.base.describe()
        return f"QAT({base}, grad={self.grad}{', stochastic rounding' if self.stochastic_rounding else ''})"
