"""torchqkit::sdpa_over_filled_cache(query, key, value, attn_mask, scale, enable_gqa): attention over the filled
positions of a static KV cache.

query (B, Hq, Lq, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv) with Hq % Hkv == 0 (grouped-query attention when
enable_gqa), attn_mask bool (True = visible) or additive float, broadcastable to (B, Hq, Lq, S):
softmax(query key^T * scale + mask) value, the same as F.scaled_dot_product_attention over the whole cache,
computed over the key positions [0, n) only, n = one past the last position the mask lets any query see (a bool
True, or an additive value above its dtype's lowest, which transformers writes where a position is masked). The
positions cut had zero weight. When no position is visible, all S take part. n depends on the mask's values: the
op slices at run time, so a compiled decode step keeps its static shapes (see Note [Filled-cache attention] in
torchqkit/eval/filled_cache_attention.py). Backends: csrc/cpu (decode_attention*.cpp) on CPU; elsewhere the
reference.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..registry import define_op

__all__ = ["sdpa_over_filled_cache_ref"]


def _last_visible(allowed: torch.Tensor) -> int:
    """One past the last key position any query may see (`allowed` broadcastable to (B, Hq, Lq, S)), or S when
    the mask hides every one (then sdpa's rules decide over the whole cache)."""
    allowed = allowed.reshape(-1, allowed.shape[-1])
    seen = (np.flatnonzero(allowed.numpy().any(axis=0)) if allowed.device.type == "cpu"
            else allowed.any(dim=0).nonzero().flatten().tolist())
    return int(seen[-1]) + 1 if len(seen) else allowed.shape[-1]


def sdpa_over_filled_cache_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor,
                               scale: float, enable_gqa: bool) -> torch.Tensor:
    """sdpa over the key / value positions [0, n) (module docstring): the definition the C++ kernel is tested against."""
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min
    n = _last_visible(allowed.expand(*allowed.shape[:-1], key.shape[2]))
    # A mask that adds nothing to any kept position (all True, or all 0.0) says nothing: sdpa without one takes its
    # fast path.
    mask = attn_mask[..., :n]
    if n > 0 and bool((mask if mask.dtype == torch.bool else mask == 0).all()):
        mask = None
    return F.scaled_dot_product_attention(query, key[:, :, :n], value[:, :, :n], attn_mask=mask, scale=scale,
                                          enable_gqa=enable_gqa)


def _fake(query, key, value, attn_mask, scale, enable_gqa):
    # The C++ kernel allocates its output the same way (strides included): compiled code relies on them.
    if value.shape[-1] == query.shape[-1]:
        return torch.empty_like(query)
    return query.new_empty(*query.shape[:-1], value.shape[-1])


define_op("torchqkit::sdpa_over_filled_cache",
          "(Tensor query, Tensor key, Tensor value, Tensor attn_mask, float scale, bool enable_gqa) -> Tensor",
          reference=sdpa_over_filled_cache_ref, fake=_fake)
