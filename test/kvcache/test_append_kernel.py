"""torchqkit::kv_cache_append: the C++ CPU kernel (csrc/cpu/kv_cache_append.cpp) writes the reference's codes, scales,
zero points, tail and counts bit for bit, call after call; a refused call changes nothing."""
from __future__ import annotations

import pytest
import torch

from torchqkit import kernels
from torchqkit.kernels.reference import kv_cache_append_ref
from torchqkit.kvcache import KVCacheConfig
from torchqkit.kvcache.cache import KVStore

from ..kernels.cpu_kernel_testing import gen

OP = torch.ops.torchqkit.kv_cache_append
needs_ext = pytest.mark.skipif(
    not kernels.CPU_EXTENSION_LOADED or not torch._C._dispatch_has_kernel_for_dispatch_key(
        "torchqkit::kv_cache_append", "CPU"), reason="no C++ CPU kernel for torchqkit::kv_cache_append")

CASES = [  # (config, head dim, chunks of positions appended one call after the other)
    pytest.param(KVCacheConfig("int8"), 64, (37, 1, 1, 1), id="int8-token-prefill-then-decode"),
    pytest.param(KVCacheConfig("int8", key_granularity="channel", group_size=16), 64, (20, 1, 11, 1, 1),
                 id="int8-channel-blocks-fill"),
    pytest.param(KVCacheConfig("int4", key_granularity="channel", group_size=8, residual_length=5), 16,
                 (3, 1, 9, 1, 1, 7), id="int4-channel-residual"),
    pytest.param(KVCacheConfig("int4", group_size=13, residual_length=3), 13, (6, 1, 1, 4), id="int4-token-odd-d"),
    pytest.param(KVCacheConfig("float8_e4m3fn", group_size=32), 64, (10, 1, 1), id="e4m3-token"),
    pytest.param(KVCacheConfig("float8_e5m2", key_granularity="channel", group_size=4, residual_length=2), 16,
                 (9, 1, 2, 1), id="e5m2-channel-residual"),
]


def _states(total, d, seed):
    g = gen(seed)
    x = torch.randn(2, 3, total, d, generator=g) * 3 + torch.linspace(-4, 4, d)  # per-channel offsets, as keys have
    x[0, 1, min(2, total - 1)] = 0.0  # a zero-range row (per-token groups get scale 1)
    x[1, 0, :, 5] = 7.5  # a constant channel (per-channel blocks of one value)
    return x


def _store(cfg, d, capacity, per_channel):
    return KVStore.empty(2, 3, d, capacity, cfg, per_channel, "cpu")


def _append(fn, store, states, cfg, per_channel):
    fn(store.codes, store.scale, store.zero, store.tail, store.counts, states, cfg.dtype, cfg.group_size,
       per_channel, cfg.residual_length, "layer 0 keys")


def _assert_same(got: KVStore, want: KVStore):
    for field in ("codes", "scale", "zero", "tail", "counts"):
        a, b = getattr(got, field), getattr(want, field)
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float16 else a,
                           b.view(torch.uint8) if b.dtype == torch.float16 else b), field


@needs_ext
@pytest.mark.parametrize("per_channel_side", [True, False], ids=["keys", "values"])
@pytest.mark.parametrize("cfg,d,chunks", CASES)
def test_kernel_writes_the_reference_bytes(cfg, d, chunks, per_channel_side):
    per_channel = cfg.key_per_channel and per_channel_side
    states = _states(sum(chunks), d, seed=len(chunks))
    got, want = _store(cfg, d, sum(chunks) + 2, per_channel), _store(cfg, d, sum(chunks) + 2, per_channel)
    at = 0
    for size in chunks:
        part = states[:, :, at:at + size]
        _append(OP, got, part, cfg, per_channel)
        _append(kv_cache_append_ref, want, part, cfg, per_channel)
        _assert_same(got, want)
        at += size
    assert got.counts[0] == sum(chunks) and 0 < got.counts[1] <= sum(chunks)


@needs_ext
def test_bfloat16_states_are_appended_as_their_float32_values():
    cfg = KVCacheConfig("int8", key_granularity="channel", group_size=4)
    states = _states(9, 16, seed=3).to(torch.bfloat16)
    got, want = _store(cfg, 16, 12, True), _store(cfg, 16, 12, True)
    _append(OP, got, states, cfg, True)
    _append(kv_cache_append_ref, want, states, cfg, True)
    _assert_same(got, want)


@needs_ext
def test_refused_calls_change_nothing():
    cfg = KVCacheConfig("int8", group_size=16)
    store = _store(cfg, 16, 8, False)
    _append(OP, store, _states(5, 16, seed=0), cfg, False)
    before = KVStore(*(t.clone() for t in (store.codes, store.scale, store.zero, store.tail, store.counts)))
    with pytest.raises(ValueError, match="layer 0 keys: 4 new positions after 5 need 9, past the cache's max_length=8"):
        _append(OP, store, _states(4, 16, seed=1), cfg, False)
    bad = _states(2, 16, seed=2)
    bad[1, 2, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"layer 0 keys: the new positions hold NaN / Inf values \(position 6, "
                                         r"channel 3\); the cache is unchanged"):
        _append(OP, store, bad, cfg, False)
    huge = _states(1, 16, seed=3)
    huge[0, 0, 0, :2] = torch.tensor([-1e7, 1e7])
    with pytest.raises(ValueError, match="whose scale or zero point float16 can't hold; the cache is unchanged"):
        _append(OP, store, huge, cfg, False)
    _assert_same(store, before)
