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
    """Quantization-aware training towards ``base``: what ``prepare_qat_`` fake-quantizes and ``convert_qat_``
    quantizes.

    The layers train in float with their weights (and, for configs that quantize activations, inputs)
    fake-quantized in the forward exactly as ``base`` will quantize them. ``to_dict()`` / ``QATConfig.from_dict(d)``
    round-trip it; ``describe()`` gives a short text.

    Args:
        base (QuantConfig | ModuleConfigs): any config with a per-weight recipe (not the calibrated configs or
            the static activation configs), or a ``ModuleConfigs`` of them.
        grad (str): the gradient through the fake quantizer: ``"ste"`` (default; straight-through, 1 everywhere)
            or ``"clipped_ste"`` (0 where a value was clipped to the first / last code, 1 elsewhere).
        stochastic_rounding (bool): round weights up or down at random in the training forward (integer formats
            only; unbiased in expectation). Conversion rounds to nearest, so it then no longer matches the last
            forward exactly. Default False.
        seed (int): seeds the stochastic rounding streams (one ``torch.Generator`` per layer, seed + layer index);
            default 0.

    Raises:
        TypeError: ``base`` is not a config or ``ModuleConfigs``, or ``stochastic_rounding`` / ``seed`` has the
            wrong type.
        ValueError: ``grad`` is not ``"ste"`` or ``"clipped_ste"``.

    Example:
        ```python
        import torchqkit as qk
        config = qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32), grad="clipped_ste")
        qk.prepare_qat_(model, config)
        ```
    """
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
