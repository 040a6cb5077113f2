"""Helpers for the quantized KV cache tests: one side of a layer filled through the append op, and the attention op's
arguments."""
from __future__ import annotations

import pytest
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


def attention_mask(kind, lq, n, width):
    """None (causal), or a (1, 1, Lq, width) mask: causal rows for the last Lq of n positions, with positions 2..4
    hidden as well (a sliding window's kind of hole), bool or additive."""
    if kind is None:
        return None
    rows = torch.arange(n - lq, n).unsqueeze(1)
    visible = torch.arange(width).unsqueeze(0) <= rows
    visible[:, 2:5] = False
    visible = visible.reshape(1, 1, lq, width)
    if kind == "bool":
        return visible
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)


# The attention kernels' cases (C++ and Triton): (config, hq, hkv, lq, n, d, append chunks, mask kind)
ATTENTION_CASES = [
    pytest.param(KVCacheConfig("int8"), 9, 3, 1, 100, 64, (99, 1), None, id="int8-smollm2-decode"),
    pytest.param(KVCacheConfig("int8", key_granularity="channel", group_size=16, residual_length=8), 4, 2, 3, 77, 64,
                 (40, 1, 36), None, id="int8-channel-residual-lq3"),
    pytest.param(KVCacheConfig("int4", key_granularity="channel", group_size=32), 6, 2, 1, 70, 64, (69, 1), "bool",
                 id="int4-channel-boolmask"),
    pytest.param(KVCacheConfig("int4", group_size=13, residual_length=3), 2, 1, 2, 30, 13, (None,), "float",
                 id="int4-token-odd-d"),
    pytest.param(KVCacheConfig("float8_e4m3fn", group_size=32), 4, 4, 1, 50, 64, (49, 1), "float", id="e4m3-mha"),
    pytest.param(KVCacheConfig("float8_e5m2", key_granularity="channel", group_size=8, residual_length=4), 8, 2, 5, 45,
                 16, (20, 25), None, id="e5m2-channel-lq5"),
]
