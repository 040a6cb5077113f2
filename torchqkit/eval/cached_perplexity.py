"""Perplexity scored token by token through a KV cache: what a quantized KV cache does to a long context.

    from torchqkit.eval import cached_perplexity
    ppl = cached_perplexity(model, ids[:1024], kv_cache=qk.KVCacheConfig("int8"))
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..progress import ProgressLine
from .decode import cache_argument
from .perplexity import check_token_ids, model_vocab_size

__all__ = ["cached_perplexity"]


def cached_perplexity(model: nn.Module, input_ids: torch.Tensor, kv_cache=None, *, cache=None,
                      progress: bool = True) -> float:
    """exp(mean negative log-likelihood) of tokens 1..T-1 of `input_ids`, each predicted by a one-token forward that
    reads every earlier position from the KV cache (the way decoding reads it), so each token's context is all the
    tokens before it.

    model: a transformers causal LM taking a cache and `cache_position`. kv_cache: a torchqkit.KVCacheConfig (a
    QuantizedKVCache of that format, the model on "sdpa" attention), or None. cache: a ready transformers Cache
    instead (e.g. transformers' own QuantizedCache, for comparison); neither: a DynamicCache in the model's dtype.
    The model's attention implementation is restored afterwards.
    """
    from transformers import DynamicCache

    ids = check_token_ids(input_ids, model_vocab_size(model))
    if kv_cache is not None and cache is not None:
        raise ValueError("cached_perplexity: pass kv_cache (a KVCacheConfig) or cache (a transformers Cache), not both")
    own = getattr(model.config, "_attn_implementation", None)
    if kv_cache is not None:
        from ..kvcache.cache import QuantizedKVCache

        cache = QuantizedKVCache(model.config, kv_cache, max_length=ids.numel())
    elif cache is None:
        cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    ids = ids.to(device)
    arg = cache_argument(model)
    bar = ProgressLine("cached perplexity", ids.numel() - 1, enabled=progress)
    nll = 0.0
    try:
        with torch.inference_mode():
            for i in range(ids.numel() - 1):
                position = torch.tensor([i], device=device)
                logits = model(input_ids=ids[i:i + 1].unsqueeze(0), cache_position=position,
                               position_ids=position.unsqueeze(0), use_cache=True, **{arg: cache}).logits
                nll += F.cross_entropy(logits[0, -1:].float(), ids[i + 1:i + 2], reduction="sum").double().item()
                bar.update(i + 1, f"ppl {math.exp(nll / (i + 1)):.3f}")
    finally:
        bar.close()
        if getattr(model.config, "_attn_implementation", None) != own:
            model.config._attn_implementation = own
    return math.exp(nll / (ids.numel() - 1))
