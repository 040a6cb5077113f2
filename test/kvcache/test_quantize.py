"""The cache's reference encoder (quantize_kv) and decoder (kv_rows), and the append op's residual behaviour."""
from __future__ import annotations

import pytest
import torch

from torchqkit.core import qdtypes
from torchqkit.core.primitives import code_midpoint
from torchqkit.kernels.reference import kv_rows
from torchqkit.kvcache import KVCacheConfig, quantize_kv
from torchqkit.kernels.ops.kv_cache_append import pack_int4_codes
from torchqkit.kernels.ops.sdpa_quantized_kv_cache import unpack_int4_codes

from ..common import sqnr
from ..kernels.cpu_kernel_testing import gen
from .kv_testing import filled_store


@pytest.mark.parametrize("fmt,qdtype", [("int8", qdtypes.uint8), ("int4", qdtypes.uint4)])
@pytest.mark.parametrize("per_channel", [False, True], ids=["token", "channel"])
def test_values_on_the_grid_come_back_exactly(fmt, qdtype, per_channel):
    """Rows built as (q - mid) * s + z with codes spanning 0..qmax in every group, float16-exact s and z: the encoder
    finds the same codes, scale and zero point, and the decoder rebuilds the rows bit for bit."""
    g = gen(0)
    b, h, n, d, group = 1, 2, 16, 16, 8
    block = (1, 1, group, 1) if per_channel else (1, 1, 1, group)
    blocks = (b, h, n // group, d) if per_channel else (b, h, n, d // group)
    codes = torch.randint(0, int(qdtype.qmax) + 1, (b, h, n, d), generator=g)
    # force each group to reach both ends of the code range, so min / max give back the same scale and zero
    view = codes.view(b, h, n // group, group, d) if per_channel else codes.view(b, h, n, d // group, group)
    if per_channel:
        view[:, :, :, 0, :], view[:, :, :, 1, :] = 0, int(qdtype.qmax)
    else:
        view[..., 0], view[..., 1] = 0, int(qdtype.qmax)
    scale = torch.randint(1, 64, blocks, generator=g).float() / 256  # float16-exact
    zero = torch.randint(-64, 64, blocks, generator=g).float() / 16 + (code_midpoint(qdtype) * scale)
    expand = (lambda t: t.repeat_interleave(group, dim=2)) if per_channel else (
        lambda t: t.repeat_interleave(group, dim=3))
    x = (codes.float() - code_midpoint(qdtype)) * expand(scale) + expand(zero)
    got_codes, got_scale, got_zero = quantize_kv(x, fmt, group, per_channel)
    assert got_scale.dtype == torch.float16 and got_scale.shape == blocks
    torch.testing.assert_close(got_scale.float(), scale, rtol=0, atol=0)
    unpacked = unpack_int4_codes(got_codes, d) if fmt == "int4" else got_codes
    assert torch.equal(unpacked.long(), codes)
    rows = kv_rows(got_codes, got_scale, got_zero, x.new_zeros(b, h, 1, d), torch.tensor([n, n]), fmt, group,
                   per_channel)
    assert torch.equal(rows, x)


def test_int4_packing_is_low_nibble_first_and_handles_odd_dims():
    codes = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.uint8)
    packed = pack_int4_codes(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x05]]
    assert torch.equal(unpack_int4_codes(packed, 5), codes)


# SQNR of rows through the cache, dB (N(0, 1) rows with per-channel offsets -3..3); int8 / int4 asymmetric per group of
# 64, float8 absmax per group. Measured per token / per channel: int8 46.6 / 51.7, int4 22.0 / 27.0, e4m3 31.8 / 31.7,
# e5m2 25.9 / 25.6; budgets a few dB under the per-token figures.
SQNR_DB = {"int8": 42.0, "int4": 19.0, "float8_e4m3fn": 28.0, "float8_e5m2": 22.0}


@pytest.mark.parametrize("fmt", list(SQNR_DB))
@pytest.mark.parametrize("per_channel", [False, True], ids=["token", "channel"])
def test_sqnr_of_rows_through_the_cache(fmt, per_channel):
    x = torch.randn(1, 3, 128, 64, generator=gen(1)) + torch.linspace(-3, 3, 64)
    store = filled_store(x, KVCacheConfig(fmt), per_channel)
    rows = kv_rows(store.codes, store.scale, store.zero, store.tail, store.counts, fmt, 64, per_channel)
    assert sqnr(x, rows) >= SQNR_DB[fmt]


def test_residual_positions_stay_float_and_the_rest_is_quantized_in_order():
    """Per token, residual 4: after 10 positions 6 are codes and the last 4 float32 (bit for bit); appending one at a
    time moves the oldest float one into the codes, quantized as it would have been at once (rows are independent)."""
    x = torch.randn(1, 2, 13, 16, generator=gen(2))
    cfg = KVCacheConfig("int8", group_size=8, residual_length=4)
    store = filled_store(x[:, :, :10], cfg, False, capacity=13)
    assert store.counts.tolist() == [10, 6]
    assert torch.equal(store.tail[:, :, :4], x[:, :, 6:10])
    step = filled_store(x, cfg, False, chunks=(10, 1, 1, 1))
    once = filled_store(x, cfg, False)
    assert step.counts.tolist() == once.counts.tolist() == [13, 9]
    assert torch.equal(step.codes, once.codes) and torch.equal(step.scale, once.scale)
    assert torch.equal(step.tail[:, :, :4], x[:, :, 9:13])


def test_per_channel_keys_wait_for_a_full_block():
    """Per channel, groups of 8 positions, residual 0: 10 positions -> one block of codes, 2 float; 6 more fill the
    second block and the tail empties; the rows match a cache filled at once."""
    x = torch.randn(1, 2, 16, 16, generator=gen(3))
    cfg = KVCacheConfig("int4", key_granularity="channel", group_size=8)
    store = filled_store(x[:, :, :10], cfg, True, capacity=16)
    assert store.counts.tolist() == [10, 8]
    assert torch.equal(store.tail[:, :, :2], x[:, :, 8:10])
    step = filled_store(x, cfg, True, chunks=(10, 3, 3))
    once = filled_store(x, cfg, True)
    assert step.counts.tolist() == [16, 16]
    assert torch.equal(step.codes, once.codes) and torch.equal(step.scale, once.scale)
    assert torch.equal(step.zero, once.zero)


def test_config_rejects_what_it_cannot_store():
    with pytest.raises(ValueError, match="dtype 'int3' is not one of"):
        KVCacheConfig("int3")
    with pytest.raises(ValueError, match="values are quantized per token only"):
        KVCacheConfig(value_granularity="channel")
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        KVCacheConfig(group_size=0)
    with pytest.raises(ValueError, match="residual_length must be an int >= 0"):
        KVCacheConfig(residual_length=-1)


def test_append_op_opcheck_and_its_error_names_the_layer():
    from torchqkit.kvcache.cache import KVStore

    cfg = KVCacheConfig("int4", key_granularity="channel", group_size=8, residual_length=2)
    store = KVStore.empty(1, 2, 16, 24, cfg, True, "cpu")
    states = torch.randn(1, 2, 11, 16, generator=gen(4))
    args = (store.codes, store.scale, store.zero, store.tail, store.counts, states, "int4", 8, True, 2, "layer 3 keys")
    torch.library.opcheck(torch.ops.torchqkit.kv_cache_append.default, args)
    fresh = KVStore.empty(1, 2, 16, 24, cfg, True, "cpu")
    torch.ops.torchqkit.kv_cache_append(fresh.codes, fresh.scale, fresh.zero, fresh.tail, fresh.counts, states,
                                        *args[6:])
    with pytest.raises(ValueError, match="layer 3 keys: 14 new positions after 11 need 25, past the cache's "
                                         "max_length=24"):
        torch.ops.torchqkit.kv_cache_append(fresh.codes, fresh.scale, fresh.zero, fresh.tail, fresh.counts,
                                            torch.randn(1, 2, 14, 16), *args[6:])
    assert fresh.counts.tolist() == [11, 8]  # the refused call changed nothing


@pytest.mark.parametrize("fmt", ["int8", "int4", "float8_e4m3fn"])
@pytest.mark.parametrize("per_channel,residual", [(True, 0), (False, 8)])
def test_reference_reads_a_cache_with_nothing_quantized_yet(fmt, per_channel, residual):
    # the first positions of a per-channel (block not full) or residual cache live in the tail only: the reference
    # decoder returns them as they are (it used to hand core a 0-row tile, which core refuses)
    cfg = KVCacheConfig(fmt, key_granularity="channel" if per_channel else "token", group_size=16,
                        residual_length=residual)
    states = torch.randn(1, 2, 5, 32, generator=gen(0))
    store = filled_store(states, cfg, per_channel, chunks=(1, 1, 3), capacity=40)
    assert store.counts.tolist() == [5, 0]
    rows = kv_rows(store.codes, store.scale, store.zero, store.tail, store.counts, fmt, 16, per_channel, 32)
    assert torch.equal(rows, states)
