"""The transformers attention function that reads a QuantizedKVCache layer's codes (torchqkit::sdpa_quantized_kv_cache).

See Note [Handing the quantized layer to attention] in cache.py.
"""
from __future__ import annotations

import torch

from ..kernels import choose_backend  # noqa: F401  (importing kernels defines the ops and loads the C++ CPU kernel)

__all__ = ["QUANTIZED_KV_ATTENTION", "quantized_kv_sdpa", "register_quantized_kv_attention"]

QUANTIZED_KV_ATTENTION = "torchqkit_quantized_kv"
LAYER_KWARG = "torchqkit_kv_layer"


def quantized_kv_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: attention over the QuantizedKVCache layer the cache's update() handed over
    (its codes, read by the kernel); transformers' sdpa for anything else (another cache, no cache)."""
    layer = kwargs.pop(LAYER_KWARG, None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    for name in ("softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} (layer {layer.index}): QuantizedKVCache attention does not "
                             f"take `{name}`; use a float cache for this model")
    if dropout:
        raise ValueError(f"{type(module).__name__}: attention dropout {dropout} with a QuantizedKVCache; call "
                         f"model.eval()")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cfg = layer.config
    k, v = layer.keys_store, layer.values_store
    out = torch.ops.torchqkit.sdpa_quantized_kv_cache(
        query, k.codes, k.scale, k.zero, k.tail, k.counts, v.codes, v.scale, v.zero, v.tail, v.counts, attention_mask,
        scale, query.shape[1] != k.codes.shape[1], cfg.dtype, cfg.group_size, cfg.key_per_channel, cfg.dtype,
        cfg.value_group)
    return out.transpose(1, 2).contiguous(), None


def register_quantized_kv_attention() -> str:
    """Register the attention function (and sdpa's mask) with transformers under QUANTIZED_KV_ATTENTION."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(QUANTIZED_KV_ATTENTION, quantized_kv_sdpa)
    AttentionMaskInterface.register(QUANTIZED_KV_ATTENTION, sdpa_mask)
    return QUANTIZED_KV_ATTENTION
