"""SparsityConfig: N:M pruning of every selected Linear, optionally quantizing the kept values with a base config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...core.granularity import PerGroup
from ...core.qdtype import QKind
from ...layouts.nm_format import check_pattern
from ...layouts.nm_sparse import NMSparseLayout
from ..quantize_weight import UnsupportedWeight
from ..sparsify import magnitude_sparse_weight
from .base import QuantConfig, recipe_for, register_config

__all__ = ["SparsityConfig"]


def _sparsity_handler(config: "SparsityConfig", weight, name: str):
    if config.needs_calibration_data():
        raise UnsupportedWeight(f"{name}: SparsityConfig(method={config.method!r}) prunes with statistics of the "
                                f"layer's inputs, and {name} was not calibrated (quantize_ calibrates the Linears "
                                f"of the model's decoder blocks, given calibration_data=...); prune it with "
                                f"method='magnitude' or keep it dense")
    return magnitude_sparse_weight(config, weight, name)


@register_config(_sparsity_handler)
@dataclass(frozen=True, kw_only=True)
class SparsityConfig(QuantConfig):
    """N:M sparsity: keep ``n`` of every ``m`` consecutive input weights of each row, chosen by ``method``, and store
    only the kept values (``NMSparseLayout``), optionally quantized by ``base``.

    ``quantize_(model, SparsityConfig(...), calibration_data=...)`` prunes every selected Linear. ``"magnitude"``
    keeps the largest |w| of each block (no data; a weight that is already N:M keeps exactly its nonzeros);
    ``"wanda"`` the largest |w| * ||x||_2 (the input feature's norm over the calibration tokens); ``"sparsegpt"``
    prunes column by column and updates the remaining weights to compensate, from the Hessian of the inputs, and with
    a ``base`` quantizes the kept weights in the same pass (GPTQ's sweep). Wanda and SparseGPT run block by block on
    ``calibration_data`` like GPTQ. With a ``base`` weight config (int4 / int8 / float8 weight-only, ...) the kept
    values are stored as its codes with its scales (chosen from the kept values only), in ``NMSparseLayout``
    instead of the base's own layout; without one they stay in the weight's float dtype. Pruned weights dequantize
    to exactly 0. ``in_features`` that ``m`` doesn't divide are padded inside the layout.

    Args:
        pattern (tuple[int, int]): ``(n, m)``, 1 <= n < m <= 128; default ``(2, 4)``.
        method (str): ``"magnitude"`` (default), ``"wanda"`` or ``"sparsegpt"`` (the last two need
            ``calibration_data``).
        base (QuantConfig | None): a weight config that quantizes each weight on its own and stores integer codes
            of up to 8 bits or float8 (``Int4WeightOnlyConfig``, ``Int8WeightOnlyConfig``, ``IntxWeightOnlyConfig``,
            ``Float8WeightOnlyConfig``, the dynamic-activation configs, ...); its layout is replaced by
            ``NMSparseLayout`` and its ``kernel_preference`` applies. None (default): keep float values.
        damp (float): SparseGPT's dampening, the fraction of the mean Hessian diagonal added to it, in (0, 1];
            default 0.01.
        block (int): SparseGPT's columns per lazy update, >= 1; default 128 (speed only).
        kernel_preference (KernelPreference): which implementation serves the linear when ``base`` is None; default
            ``KernelPreference.AUTO``.

    Raises:
        ValueError: a pattern that is not N:M, an out-of-range ``damp`` / ``block``, a base whose groups don't hold
            whole blocks of ``m``, or a base format ``NMSparseLayout`` can't store (codebooks such as nf4).
        TypeError: a base that needs calibration itself (GPTQ, AWQ, ...) or a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.SparsityConfig(pattern=(2, 4)))            # magnitude 2:4, float values
        config = qk.SparsityConfig(pattern=(2, 4), method="sparsegpt", base=qk.Int4WeightOnlyConfig(group_size=32))
        report = qk.quantize_(other_model, config, calibration_data=batches)
        print(report)                                                      # compressed bytes per layer
        ```
    """
    pattern: tuple[int, int] = (2, 4)
    method: Literal["magnitude", "wanda", "sparsegpt"] = "magnitude"
    base: QuantConfig | None = None
    damp: float = field(default=0.01, metadata={"gt": 0.0, "le": 1.0})
    block: int = field(default=128, metadata={"ge": 1})

    def __post_init__(self):
        super().__post_init__()
        if len(self.pattern) != 2:
            raise ValueError(f"SparsityConfig: pattern must be (n, m), got {self.pattern!r}")
        check_pattern(*self.pattern, what="SparsityConfig: pattern")
        if self.base is not None:
            self._check_base()

    def _check_base(self) -> None:
        name = type(self.base).__name__
        try:
            recipe = recipe_for(self.base)
        except TypeError:
            raise TypeError(f"SparsityConfig: base {name} chooses its codes from more than the weight (calibration); "
                            f"use its weight config as base (e.g. Int4WeightOnlyConfig) and method='sparsegpt' to "
                            f"choose codes from calibration data while pruning") from None
        qdtype, (n, m) = recipe.qdtype, self.pattern
        if qdtype.kind not in (QKind.INT, QKind.FLOAT8) or qdtype.bits > 8:
            raise ValueError(f"SparsityConfig: base {name} stores {qdtype.name} codes, which NMSparseLayout can't hold "
                             f"(it keeps integer codes of 1..8 bits, float8 or float values); use an integer or float8 "
                             f"weight config, or base=None")
        granularity = recipe.granularity
        if isinstance(granularity, PerGroup) and granularity.group_size % m:
            raise ValueError(f"SparsityConfig: base {name} has groups of {granularity.group_size} input features, "
                             f"which don't hold whole blocks of {m}; use a group size that is a multiple of {m}")

    @property
    def layout(self) -> NMSparseLayout:
        """The layout pruned weights are stored in: ``NMSparseLayout(n, m)``."""
        return NMSparseLayout(*self.pattern)

    def needs_calibration_data(self) -> bool:
        return self.method != "magnitude"

    def needs_hessian(self) -> bool:
        """True when calibration must collect the Hessian of each Linear's inputs (SparseGPT)."""
        return self.method == "sparsegpt"

    def describe(self):
        n, m = self.pattern
        return f"{n}:{m} {self.method}" + ("" if self.base is None else f" + {self.base.describe()}")
