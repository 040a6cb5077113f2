"""rotate_: QuaRot-style orthogonal rotations folded into a LLaMA-family model's float weights, before quantize_.

The rewrite itself is algorithms/rotation.py (Note [Residual rotation]); this module checks the request, applies
the new weights all at once and says what it did.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from ..algorithms.hadamard import hadamard_order
from ..algorithms.rotation import (OnlineRotation, RotationError, decoder_parts, online_rotation_of,
                                   orthogonal_matrix, rotate_decoder)
from .configs.base import check_fields

__all__ = ["RotationConfig", "RotationReport", "rotate_"]


@dataclass(frozen=True, kw_only=True)
class RotationConfig:
    """Which orthogonal rotations ``rotate_`` folds into a model (QuaRot-style).

    Args:
        kind (str): the residual stream's rotation: ``"hadamard"`` (default; diag(random signs) H / sqrt(hidden),
            a randomized Hadamard matrix, where an order-hidden Hadamard matrix is built, else a random orthogonal
            matrix) or ``"random"`` (a random orthogonal matrix, and for down_proj's input too).
        seed (int): seeds the random signs / matrices (>= 0); default 0. The same seed gives the same weights.
        online_down_proj (bool): rotate down_proj's input on every call (a forward pre-hook applying a Hadamard
            transform, its inverse folded into down_proj's weight), so its activations are outlier-free too;
            default True. Needed for 4-bit activations; int8 activations do without.
        rotate_ov (bool): rotate each value head by a Hadamard matrix of order head_dim, undone in o_proj's input
            columns (offline, no run-time cost), so o_proj's activations are rotated too; default True.

    Raises:
        ValueError: an unknown ``kind`` or a negative seed.
        TypeError: a field of the wrong type.

    Example:
        ```python
        import torchqkit as qk
        config = qk.RotationConfig(kind="hadamard", seed=1)
        assert qk.RotationConfig.from_dict(config.to_dict()) == config
        ```
    """
    kind: Literal["hadamard", "random"] = "hadamard"
    seed: int = field(default=0, metadata={"ge": 0})
    online_down_proj: bool = True
    rotate_ov: bool = True

    def __post_init__(self):
        check_fields(self)

    def to_dict(self) -> dict:
        """The config as a JSON-able dict, ``{"type": "RotationConfig", ...fields}``."""
        return {"type": "RotationConfig", **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(d: dict) -> "RotationConfig":
        """The config ``to_dict`` made; TypeError for another type or unknown fields."""
        if not isinstance(d, dict) or d.get("type") != "RotationConfig":
            raise TypeError(f"RotationConfig.from_dict: expected a dict with type 'RotationConfig', got {d!r:.80}")
        fields = {k: v for k, v in d.items() if k != "type"}
        names = {f.name for f in dataclasses.fields(RotationConfig)}
        if set(fields) - names:
            raise TypeError(f"RotationConfig.from_dict: unknown fields {sorted(set(fields) - names)}; fields: "
                            f"{sorted(names)}")
        return RotationConfig(**fields)


@dataclass
class RotationReport:
    """What ``rotate_`` did.

    Args:
        residual (str): the residual stream's rotation, e.g. ``"randomized hadamard 576 (36 x 16)"``.
        down_proj (str): down_proj's online input rotation (``"hadamard 1536 (12 x 128), online"``) or ``"none"``.
        value_output (str): the per-head value / o_proj rotation, or ``"none"`` and why.
        untied_lm_head (bool): the lm_head shared the embedding's weight and now has its own (the embedding is
            rotated by Q, the lm_head by diag(final norm) Q; ``config.tie_word_embeddings`` is set to False).
        layers (int): decoder layers rotated.

    Example:
        ```python
        import torchqkit as qk
        report = qk.rotate_(model)
        print(report)   # one line per rotation
        ```
    """
    residual: str
    down_proj: str
    value_output: str
    untied_lm_head: bool
    layers: int

    def __str__(self) -> str:
        return (f"rotate_: {self.layers} layers; residual: {self.residual}; down_proj input: {self.down_proj}; "
                f"value / o_proj: {self.value_output}; lm_head untied: {self.untied_lm_head}")


def _order_text(n: int) -> str:
    m, p = hadamard_order(n)
    return f"{n}" if m == 1 else f"{n} ({m} x {p})"


def rotate_(model: nn.Module, config: RotationConfig | None = None) -> RotationReport:
    """Fold orthogonal rotations into a LLaMA-family causal LM's float weights (QuaRot), in place.

    The residual stream is rotated by a randomized Hadamard matrix Q (RMSNorm weights folded into the next Linears,
    Q folded into the embedding, every Linear reading or writing the residual and the lm_head); value heads and
    o_proj's input by per-head Hadamard matrices; down_proj's input by a Hadamard transform applied on every call
    (a forward pre-hook). In float the model computes the same logits (to rounding); its Linears' inputs lose their
    outlier features, which is what lets 4-bit activations keep their quality: SmolLM2-135M with
    ``Int4DynamicActivationInt4WeightConfig(group_size=32)`` goes from perplexity 3323 to 96 (float 33.4). It is not
    free for round-to-nearest int4 weights there (weight-only 38.9 -> 53.8), but helps GPTQ's (W4A8 43.1 -> 37.6):
    rotate for low-bit activations or before GPTQ, not by default (``benchmarks/rotation_results.md``). Call it on
    the float model, then ``quantize_``.

    Supported: transformers' LlamaForCausalLM and models of the same layout (Mistral, Qwen2, Qwen3): RMSNorm ->
    Linear, separate q / k / v and gate / up projections. Hadamard orders m * 2^k with m = 1, q + 1 or 2 (q + 1)
    for a prime q (Note [Hadamard orders]); other widths get a random orthogonal matrix (the report says which).
    A tied lm_head is untied (the report says so). The online rotation is a forward pre-hook on each down_proj: it
    goes with the module object (deepcopy, pickling the whole model) but not with a state_dict or a checkpoint
    file; a model rebuilt from a checkpoint needs ``rotate_`` with the same config on its float weights, or its
    down_proj sees unrotated inputs (use ``online_down_proj=False`` for weights-only rotations).

    Args:
        model (nn.Module): a float LLaMA-family causal LM, not quantized yet.
        config (RotationConfig | None): which rotations; None (default): ``RotationConfig()``.

    Returns:
        RotationReport: the rotations applied.

    Raises:
        RotationError: (a ValueError) the model isn't a LLaMA-family causal LM, has quantized, wrapped or meta
            weights, a norm that isn't an RMSNorm, parameters outside that layout, or was rotated already; the model
            is unchanged.
        TypeError: ``config`` is not a RotationConfig.

    Example:
        ```python
        import torchqkit as qk
        report = qk.rotate_(model, qk.RotationConfig(seed=0))
        qk.quantize_(model, qk.Int4DynamicActivationInt4WeightConfig())
        ```
    """
    config = RotationConfig() if config is None else config
    if not isinstance(config, RotationConfig):
        raise TypeError(f"rotate_: config must be a RotationConfig, got {type(config).__name__}")
    parts = decoder_parts(model)
    if any(online_rotation_of(layer.mlp.down_proj) is not None for layer in parts.layers):
        raise RotationError("rotate_: the model is rotated already (its down_proj layers carry online rotations); "
                            "rotating twice would apply two online rotations. The model is unchanged")
    gen = torch.Generator().manual_seed(config.seed)
    q, q_kind = orthogonal_matrix(parts.hidden, config.kind, gen)
    residual = f"{q_kind} {_order_text(parts.hidden) if q_kind != 'random orthogonal' else parts.hidden}"
    online, down = None, "none"
    if config.online_down_proj:
        inter = parts.layers[0].mlp.down_proj.in_features if parts.layers else 0
        if config.kind == "hadamard" and hadamard_order(inter) is not None:
            online, down = OnlineRotation(inter), f"hadamard {_order_text(inter)}, online"
        else:
            online = OnlineRotation(inter, orthogonal_matrix(inter, "random", gen)[0].float())
            down = f"random orthogonal {inter}, online (a {inter} x {inter} matmul per call)"
    rotate_ov = config.rotate_ov and hadamard_order(parts.head_dim) is not None
    value_output = (f"hadamard {_order_text(parts.head_dim)} per head" if rotate_ov else
                    "none (rotate_ov=False)" if not config.rotate_ov else
                    f"none: no Hadamard matrix of order head_dim {parts.head_dim}")
    with torch.no_grad():
        new = rotate_decoder(parts, q, online, rotate_ov)
        _assign(model, parts, new)
    if online is not None:
        for layer in parts.layers:
            layer.mlp.down_proj.register_forward_pre_hook(online)
    return RotationReport(residual, down, value_output, parts.tied, len(parts.layers))


def _assign(model: nn.Module, parts, new: dict) -> None:
    """Write the new tensors into the existing Parameters (their identity, device and requires_grad stay); a tied
    lm_head gets a Parameter of its own first, and the config stops asking for ties."""
    if parts.tied:
        w = parts.lm_head.weight
        parts.lm_head.weight = nn.Parameter(torch.empty_like(w), requires_grad=w.requires_grad)
        for cfg in (getattr(model, "config", None),
                    getattr(getattr(model, "config", None), "get_text_config", lambda: None)()):
            if cfg is not None and getattr(cfg, "tie_word_embeddings", False):
                cfg.tie_word_embeddings = False
    for (module, attr), value in new.items():
        getattr(module, attr).copy_(value)
