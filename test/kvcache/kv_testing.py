"""Helpers for the quantized KV cache tests: one side of a layer filled through the append op, and the attention op's
arguments."""
from __future__ import annotations

import torch

from torchqkit.kvcache import KVCacheConfig
from torchqkit.kvcache.cache import KVStore
from torchqkit.kernels.ops.kv_cache_append import kv_cache_append


def filled_store(states: torch.Tensor, cfg: KVCacheConfig, per_channel: bool, chunks=(None,),
                 capacity: int | None = None) -> KVStore:
    """A KVStore of states (B, H, n, D) appended in `chunks` (position counts; None: the rest at once)."""
    b, h, n, d = states.shape
    store = KVStore.empty(b, h, d, capacity or n, cfg, per_channel, states.device)
    at = 0
    for size in chunks:
        size = n - at if size is None else size
        kv_cache_append(store.codes, store.scale, store.zero, store.tail, store.counts, states[:, :, at:at + size],
                        cfg.dtype, cfg.group_size, per_channel, cfg.residual_length, "test")
        at += size
    assert at == n
    return store


def op_args(query, k: KVStore, v: KVStore, mask, cfg: KVCacheConfig, scale: float = 0.125):
    return (query, k.codes, k.scale, k.zero, k.tail, k.counts, v.codes, v.scale, v.zero, v.tail, v.counts, mask, scale,
            query.shape[1] != k.codes.shape[1], cfg.dtype, cfg.group_size, cfg.key_per_channel, cfg.dtype,
            cfg.group_size)
