"""QuantizedKVCache: a transformers Cache whose layers keep K / V as codes (see Note [Quantized KV cache layout])."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import LAYER_KWARG, QUANTIZED_KV_ATTENTION, register_quantized_kv_attention
from .config import KVCacheConfig
from ..kernels.ops.kv_cache_append import code_width, kv_cache_append

__all__ = ["QuantizedKVCache", "QuantizedKVLayer", "KVStore"]

# Note [Handing the quantized layer to attention]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers' attention modules call `cache.update(key_states, value_states, layer_idx, kwargs=kwargs)` and then
# `attention_interface(self, query, key, value, mask, ..., **kwargs)` with the same kwargs dict (transformers 5.24).
# update() appends the new positions in quantized form and puts the layer itself into that dict; the attention
# function registered as QUANTIZED_KV_ATTENTION takes it from there and runs torchqkit::sdpa_quantized_kv_cache on the
# layer's codes. So no float copy of the cache is ever made: update() returns only the float tail. Because the
# float tail alone would be a wrong answer for any other attention function, the cache switches the model config's
# attention from "sdpa" to QUANTIZED_KV_ATTENTION when it is built (that function runs transformers' sdpa unchanged
# for every other cache) and refuses an update when the model runs anything else or its attention does not hand
# over its kwargs.


@dataclass
class KVStore:
    """One side (keys or values) of one layer, Note [Quantized KV cache layout]: codes, scale, zero, tail, counts."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    tail: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, capacity: int, cfg: KVCacheConfig, per_channel: bool,
              device, group: int | None = None) -> "KVStore":
        """An empty store; `group`: elements per scale (default the config's key group, `group_size`)."""
        g = cfg.group_size if group is None else group
        block = g if per_channel else 1
        scale_shape = (batch, heads, -(-capacity // g), dim) if per_channel else (batch, heads, capacity, dim // g)
        scale = torch.zeros(scale_shape, dtype=torch.float16, device=device)
        return cls(torch.zeros(batch, heads, capacity, code_width(cfg.dtype, dim), dtype=torch.uint8, device=device),
                   scale, torch.zeros_like(scale) if not cfg.dtype.startswith("float8") else scale.new_empty(0),
                   torch.zeros(batch, heads, max(1, cfg.residual_length + block - 1), dim, device=device),
                   torch.zeros(2, dtype=torch.long))

    def grown(self, capacity: int, per_channel: bool, group: int) -> "KVStore":
        """The same contents in a store of `capacity` positions (dynamic growth)."""
        def pad(t, rows):
            return torch.cat([t, t.new_zeros(*t.shape[:2], rows - t.shape[2], *t.shape[3:])], dim=2)

        scale_rows = -(-capacity // group) if per_channel else capacity
        zero = pad(self.zero, scale_rows) if self.zero.numel() else self.zero
        return KVStore(pad(self.codes, capacity), pad(self.scale, scale_rows), zero, self.tail, self.counts)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero, self.tail))


class QuantizedKVLayer(CacheLayerMixin):
    """One decoder layer's quantized keys and values (`keys_store`, `values_store`: KVStore); built by
    QuantizedKVCache. `max_length` None: grows as positions arrive; else preallocated, static shapes."""

    is_sliding = False
    is_croppable = False

    def __init__(self, config: KVCacheConfig, index: int, heads: int, head_dim: int, max_length: int | None,
                 static: bool):
        super().__init__()
        self.config, self.index, self.heads, self.head_dim = config, index, heads, head_dim
        self.max_length, self.static = max_length, static
        self.is_compileable = static
        self.keys_store: KVStore | None = None
        self.values_store: KVStore | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_shapes(key_states, value_states)
        batch, device = key_states.shape[0], key_states.device
        capacity = self.max_length if self.static else max(64, key_states.shape[2])
        if self.max_length is not None:
            capacity = min(capacity, self.max_length)
        cfg = self.config
        self.keys_store = KVStore.empty(batch, self.heads, self.head_dim, capacity, cfg, cfg.key_per_channel, device)
        self.values_store = KVStore.empty(batch, self.heads, value_states.shape[-1], capacity, cfg, False, device,
                                          cfg.value_group)
        self.device = device
        self.is_initialized = True

    def _check_shapes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        want = (self.heads, self.head_dim)
        got = (key_states.shape[1], key_states.shape[-1])
        batch = self.keys_store.codes.shape[0] if self.keys_store is not None else key_states.shape[0]
        if got != want or key_states.shape[0] != batch or value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(f"QuantizedKVCache layer {self.index}: built for batch {batch}, {want[0]} kv heads of "
                             f"{want[1]}, got keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} "
                             f"(B, heads, positions, head dim); a cache serves one model and one batch: build a new "
                             f"QuantizedKVCache(model.config, ...) for this one")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new positions (quantized as they leave the float tail) and hand this layer to the attention
        function (Note [Handing the quantized layer to attention]); returns the float tails."""
        handover = kwargs.get("kwargs")
        if not isinstance(handover, dict):
            raise TypeError(f"QuantizedKVCache layer {self.index}: the model's attention called cache.update() without "
                            f"its kwargs, so its attention can't read the quantized layer; use a model whose attention "
                            f"passes them (transformers >= 5.24 LLaMA, Mistral, Qwen2, ...) or a float cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_shapes(key_states, value_states)
        if not self.static:
            self._grow(int(self.keys_store.counts[0]) + key_states.shape[2])
        cfg = self.config
        for what, store, states, per_channel, group in (
                ("keys", self.keys_store, key_states, cfg.key_per_channel, cfg.group_size),
                ("values", self.values_store, value_states, False, cfg.value_group)):
            kv_cache_append(store.codes, store.scale, store.zero, store.tail, store.counts, states, cfg.dtype,
                            group, per_channel, cfg.residual_length, f"QuantizedKVCache layer {self.index} {what}")
        handover[LAYER_KWARG] = self
        return self.keys_store.tail, self.values_store.tail

    def _grow(self, needed: int) -> None:
        capacity = self.keys_store.codes.shape[2]
        if needed <= capacity or (self.max_length is not None and capacity >= self.max_length):
            return  # fits, or at max_length already: the append op raises the error that names the layer
        capacity = max(needed, 2 * capacity)
        if self.max_length is not None:
            capacity = min(capacity, self.max_length)
        g = self.config.group_size
        self.keys_store = self.keys_store.grown(capacity, self.config.key_per_channel, g)
        self.values_store = self.values_store.grown(capacity, False, g)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.static:
            return self.max_length, 0
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self):
        if not self.is_initialized:
            return 0
        n = self.keys_store.counts[0]
        return n if self.static else int(n)

    def get_max_length(self) -> int:
        return self.max_length if self.max_length is not None else -1

    def reset(self) -> None:
        if self.is_initialized:
            if self.static:
                self.keys_store.counts.zero_()
                self.values_store.counts.zero_()
            else:
                self.keys_store = self.values_store = None
                self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"QuantizedKVCache layer {self.index}: beam search (reorder_cache) is not supported; "
                                  f"decode greedily or sample, or use a float cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"QuantizedKVCache layer {self.index}: cropping quantized positions is not "
                                  f"supported (assisted decoding needs it); use a float cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"QuantizedKVCache layer {self.index}: repeating the batch is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"QuantizedKVCache layer {self.index}: selecting batch rows is not supported")

    def offload(self):
        raise NotImplementedError("QuantizedKVCache does not offload its layers")

    def prefetch(self):
        raise NotImplementedError("QuantizedKVCache does not offload its layers")

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self.keys_store.nbytes() + self.values_store.nbytes()


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class QuantizedKVCache(Cache):
    """A transformers `Cache` that stores every layer's keys and values quantized (`KVCacheConfig`), read by
    attention straight from their codes (`torchqkit::sdpa_quantized_kv_cache`), never as a float copy.

    Pass it to `model.generate(past_key_values=...)` or to a forward loop; `torchqkit.eval.LeanDecoder(model, ...,
    kv_cache=KVCacheConfig(...))` builds a static one. Building it switches `config`'s attention from "sdpa" to
    QUANTIZED_KV_ATTENTION, which runs transformers' sdpa unchanged for every other cache (Note [Handing the quantized
    layer to attention]). Sliding-window layers keep every position (their mask hides the old ones). Beam search,
    cropping and offloading are not supported.

    Args:
        config (PretrainedConfig): the model's transformers config (`model.config`): layers, kv heads, head dim.
        kv_config (KVCacheConfig): the storage format; default int8 per token, groups of 64.
        max_length (int | None): most positions a layer holds (prompt + new tokens); None: no limit (dynamic only).
        static (bool): preallocate `max_length` positions (static shapes, for torch.compile); default False: grow as
            positions arrive.

    Raises:
        ValueError: a group size that does not divide the head dim (per-token groups), static without max_length, a
            model whose attention is neither "sdpa" nor QUANTIZED_KV_ATTENTION; later, in update: a position past
            max_length, or keys / values of another shape than the cache was built for (each naming the layer).

    Example:
        ```python
        import torchqkit as qk
        cache = qk.QuantizedKVCache(model.config, qk.KVCacheConfig("int8"), max_length=4096)
        out = model.generate(ids, max_new_tokens=32, do_sample=False, past_key_values=cache)
        print(cache.bytes_per_token(), "bytes per cached token")
        ```
    """

    def __init__(self, config, kv_config: KVCacheConfig | None = None, *, max_length: int | None = None,
                 static: bool = False):
        kv_config = KVCacheConfig() if kv_config is None else kv_config
        if not isinstance(kv_config, KVCacheConfig):
            raise TypeError(f"QuantizedKVCache: kv_config must be a KVCacheConfig, got {type(kv_config).__name__}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 1):
            raise ValueError(f"QuantizedKVCache: max_length must be a positive int or None, got {max_length!r}")
        if static and max_length is None:
            raise ValueError("QuantizedKVCache: static=True preallocates max_length positions: pass max_length")
        text = _text_config(config)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        per_token = [("value_group_size" if kv_config.value_group_size else "group_size", kv_config.value_group)]
        if not kv_config.key_per_channel:
            per_token.append(("group_size", kv_config.group_size))
        for field, group in per_token:
            if head_dim % group:
                raise ValueError(f"QuantizedKVCache layer 0: head dim {head_dim} can't be split into per-token groups "
                                 f"of {group}; use a {field} that divides {head_dim} (e.g. "
                                 f"{_divisor_near(head_dim, group)})")
        self.kv_config, self.model_config = kv_config, config
        _use_quantized_attention(config)
        super().__init__(layers=[QuantizedKVLayer(kv_config, i, heads, head_dim, max_length, static)
                                 for i in range(text.num_hidden_layers)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append key / value states (B, kv heads, positions, head dim) to layer `layer_idx` (see QuantizedKVLayer)."""
        attention = getattr(self.model_config, "_attn_implementation", None)
        if attention != QUANTIZED_KV_ATTENTION:
            raise ValueError(f"QuantizedKVCache layer {layer_idx}: the model runs attention {attention!r}, which "
                             f"would read only the float tail of the quantized cache; build the cache from this "
                             f"model's config (it switches 'sdpa' to {QUANTIZED_KV_ATTENTION!r}) or call "
                             f"model.set_attn_implementation({QUANTIZED_KV_ATTENTION!r})")
        if layer_idx >= len(self.layers):
            raise ValueError(f"QuantizedKVCache: layer {layer_idx} of a model with more layers than the "
                             f"{len(self.layers)} this cache was built for; build a new cache for this model")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def bytes_per_token(self) -> float:
        """Bytes one cached position takes in the quantized part of every layer (codes, scales and zero points,
        keys and values; the float tail of at most residual_length + group positions not counted)."""
        cfg = self.kv_config
        per_group = 2 * (1 if cfg.dtype.startswith("float8") else 2)  # float16 scale (+ float16 zero)
        total = 0.0
        for layer in self.layers:
            d = layer.head_dim
            # per token: d / g groups per position; per channel: d groups per g positions, also d / g per position
            for g in (cfg.group_size, cfg.value_group):
                total += layer.heads * (code_width(cfg.dtype, d) + per_group * d / g)
        return total

    def float_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one cached position takes in a float cache of `dtype` (keys and values of every layer)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(layer.heads * 2 * layer.head_dim * size for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes the cache holds now (codes, scales, zero points and float tails of every layer, capacity included)."""
        return sum(layer.nbytes() for layer in self.layers)


def _divisor_near(d: int, g: int) -> int:
    divisors = [x for x in range(1, d + 1) if d % x == 0]
    return min(divisors, key=lambda x: (abs(x - g), -x))


def _use_quantized_attention(config) -> None:
    """Switch the model config's attention from "sdpa" to QUANTIZED_KV_ATTENTION (Note [Handing the quantized layer to
    attention]); any other implementation is refused."""
    name = register_quantized_kv_attention()
    own = getattr(config, "_attn_implementation", None)
    if own == name:
        return
    if own != "sdpa":
        raise ValueError(f"QuantizedKVCache: the model's attention is {own!r}; the quantized cache is read by its own "
                         f"attention function, which replaces 'sdpa' only: load the model with "
                         f"attn_implementation='sdpa'")
    config._attn_implementation = name
