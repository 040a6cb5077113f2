"""QuantizedKVCache as a transformers Cache: generate() and a forward loop on a tiny LLaMA (GQA: 4 query / 2 kv heads)
against the float cache, static against dynamic, sliding-window layers, bytes per position, bad input."""
from __future__ import annotations

import pytest
import torch
import transformers

import torchqkit as qk
from torchqkit.eval import greedy_decode
from torchqkit.kvcache import QUANTIZED_KV_ATTENTION

from ..common import small_hf_llama

IDS = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model():
    m = small_hf_llama().eval()
    m.set_attn_implementation("sdpa")
    return m


def _generate(model, cache=None, new=12):
    kwargs = {} if cache is None else {"cache": cache}
    return model.generate(IDS, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)


def _logits_loop(model, cache, ids):
    """One forward per token through `cache`: the logits (T, vocab)."""
    out = []
    with torch.no_grad():
        for i in range(ids.shape[1]):
            pos = torch.tensor([i])
            out.append(model(input_ids=ids[:, i:i + 1], cache_position=pos, position_ids=pos.unsqueeze(0),
                             cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("cfg", [qk.KVCacheConfig("int8", group_size=16),
                                 qk.KVCacheConfig("int8", key_granularity="channel", group_size=8, residual_length=4),
                                 qk.KVCacheConfig("float8_e4m3fn", group_size=16)],
                         ids=["int8-token", "int8-channel-residual", "e4m3"])
def test_generate_gives_the_float_cache_tokens(model, cfg):
    cache = qk.QuantizedKVCache(model.config, cfg)
    assert torch.equal(_generate(model, cache), _generate(model))
    assert cache.get_seq_length() == 31  # 20 prompt + 11 fed back
    assert model.config._attn_implementation == QUANTIZED_KV_ATTENTION


def test_int4_logits_stay_close_to_the_float_cache(model):
    """int4 on this random model (head dim 16, sharp attention; logits of mean magnitude 1.25), 40 positions:
    per-channel keys (KIVI's layout) measure a mean |logit error| of 0.094 (max 0.85) against the float cache,
    per-token keys 0.19 with the same group size, int8 0.015 (max 0.10). Budgets above those; a wrong position or a
    garbled code gives errors of the logits' own size."""
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = _logits_loop(model, transformers.DynamicCache(config=model.config), ids)
    errors = {}
    for name, cfg in {"channel": qk.KVCacheConfig("int4", key_granularity="channel", group_size=8, residual_length=8),
                      "token": qk.KVCacheConfig("int4", group_size=8),
                      "int8": qk.KVCacheConfig("int8", group_size=16)}.items():
        errors[name] = (_logits_loop(model, qk.QuantizedKVCache(model.config, cfg), ids) - ref).abs()
    assert errors["channel"].mean() < 0.12 and errors["channel"].max() < 1.2
    assert errors["channel"].mean() < errors["token"].mean()
    assert errors["int8"].mean() < 0.02 and errors["int8"].max() < 0.15


def test_static_cache_equals_dynamic_and_prefill_quantizes_at_once(model):
    cfg = qk.KVCacheConfig("int4", key_granularity="channel", group_size=8, residual_length=4)
    dynamic = qk.QuantizedKVCache(model.config, cfg)
    static = qk.QuantizedKVCache(model.config, cfg, max_length=40, static=True)
    assert torch.equal(_generate(model, dynamic), _generate(model, static))
    for d, s in zip(dynamic.layers, static.layers):
        n = int(d.keys_store.counts[0])
        assert d.keys_store.counts.tolist() == s.keys_store.counts.tolist() == [31, 24]  # blocks of 8, 4 float
        assert d.values_store.counts.tolist() == [31, 27]  # per token: all but the last 4
        assert torch.equal(d.keys_store.codes[:, :, :n], s.keys_store.codes[:, :, :n])
    assert static.layers[0].keys_store.codes.shape[2] == 40


def test_lean_decoder_uses_the_quantized_cache(model):
    cfg = qk.KVCacheConfig("int8", group_size=16)
    model.set_attn_implementation("sdpa")
    got = greedy_decode(model, IDS[0], 12, kv_cache=cfg)
    assert torch.equal(got, _generate(model))
    assert model.config._attn_implementation == "sdpa"  # the decoder switches it back


def test_sliding_window_layers_match_the_float_cache():
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    m = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    m.set_attn_implementation("sdpa")
    ref = _generate(m)
    got = _generate(m, qk.QuantizedKVCache(m.config, qk.KVCacheConfig("int8", group_size=16)))
    assert torch.equal(got, ref)


def test_bytes_per_position_for_smollm2_shapes():
    """SmolLM2-135M: 30 layers, 3 kv heads of 64. Per layer and head, keys + values: float32 2 * 64 * 4 = 512 bytes;
    int8 g64 2 * (64 codes + 2 + 2) = 136 (0.2656x); int4 g64 (keys per channel or per token alike) 2 * (32 + 4) = 72
    (0.1406x); float8 g64 2 * (64 + 2) = 132."""
    config = transformers.LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                      num_key_value_heads=3, intermediate_size=1536, vocab_size=256)
    config._attn_implementation = "sdpa"
    per_cfg = {qk.KVCacheConfig("int8"): 136, qk.KVCacheConfig("int4", key_granularity="channel"): 72,
               qk.KVCacheConfig("float8_e4m3fn"): 132}
    for cfg, per_head in per_cfg.items():
        cache = qk.QuantizedKVCache(config, cfg)
        assert cache.bytes_per_token() == 90 * per_head
        assert cache.float_bytes_per_token() == 90 * 512
    assert 90 * 136 / (90 * 512) <= 0.27 and 90 * 72 / (90 * 512) <= 0.15


def test_bad_input_names_the_layer_and_the_way_out(model):
    with pytest.raises(ValueError, match="layer 0: head dim 16 can't be split into per-token groups of 12; use a "
                                         "group_size that divides 16"):
        qk.QuantizedKVCache(model.config, qk.KVCacheConfig("int8", group_size=12))
    cache = qk.QuantizedKVCache(model.config, qk.KVCacheConfig("int8", group_size=16), max_length=24)
    with pytest.raises(ValueError, match="layer 0 keys: 1 new positions after 24 need 25, past the cache's "
                                         "max_length=24; build the QuantizedKVCache with a larger max_length"):
        _generate(model, cache, new=6)
    other = small_hf_llama(seed=1)
    other.config.num_key_value_heads = 4
    other = transformers.LlamaForCausalLM(other.config).eval()
    other.set_attn_implementation("sdpa")
    used = qk.QuantizedKVCache(model.config, qk.KVCacheConfig("int8", group_size=16))
    _generate(model, used, new=2)
    with pytest.raises(ValueError, match="layer 0: built for batch 1, 2 kv heads of 16.*build a new QuantizedKVCache"):
        other(input_ids=IDS, cache=used, use_cache=True)
    model.set_attn_implementation("eager")
    try:
        with pytest.raises(ValueError, match="attention is 'eager'.*attn_implementation='sdpa'"):
            qk.QuantizedKVCache(model.config, qk.KVCacheConfig("int8", group_size=16))
        with pytest.raises(ValueError, match="layer 0: the model runs attention 'eager'"):
            _generate(model, used, new=2)
    finally:
        model.set_attn_implementation("sdpa")


def test_value_group_size_sets_the_values_groups_only(model):
    """int4 per-channel keys in blocks of 8 positions, values in per-token groups of 16 (the whole head) or 4: the
    finer value groups lower the logit error and cost 2 float16 (scale, zero) per 4 values instead of per 16."""
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = _logits_loop(model, transformers.DynamicCache(config=model.config), ids)
    errors, caches = {}, {}
    for groups in (16, 4):
        cfg = qk.KVCacheConfig("int4", key_granularity="channel", group_size=8, value_group_size=groups)
        caches[groups] = qk.QuantizedKVCache(model.config, cfg)
        errors[groups] = (_logits_loop(model, caches[groups], ids) - ref).abs().mean().item()
        store = caches[groups].layers[0].values_store
        assert store.scale.shape[-1] == 16 // groups  # per-token value scales: head dim 16 / value group
        assert caches[groups].layers[0].keys_store.scale.shape[-1] == 16  # per-channel keys: one per channel
    assert errors[4] < errors[16]
    # per layer and kv head: keys 8 code bytes + 16 / 8 groups * 4 bytes; values 8 + 16 / groups * 4
    layers_heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert caches[16].bytes_per_token() == layers_heads * (16 + 8 + 4)
    assert caches[4].bytes_per_token() == layers_heads * (16 + 8 + 16)
    with pytest.raises(ValueError, match="per-token groups of 5; use a value_group_size that divides 16"):
        qk.QuantizedKVCache(model.config, qk.KVCacheConfig("int4", key_granularity="channel", value_group_size=5))
    with pytest.raises(ValueError, match="value_group_size must be an int >= 1 or None"):
        qk.KVCacheConfig(value_group_size=0)
