"""Quantized KV cache: KVCacheConfig (the format), QuantizedKVCache (a transformers Cache of codes, imported on first
use: it subclasses a transformers class), and the attention function that reads it
(torchqkit::sdpa_quantized_kv_cache). See docs/architecture.md, "Where new pieces go"."""
from .attention import QUANTIZED_KV_ATTENTION, quantized_kv_sdpa, register_quantized_kv_attention
from .config import KV_DTYPES, KVCacheConfig
from ..kernels.ops.kv_cache_append import quantize_kv

__all__ = ["KVCacheConfig", "KV_DTYPES", "QuantizedKVCache", "QuantizedKVLayer", "KVStore", "QUANTIZED_KV_ATTENTION",
           "quantized_kv_sdpa", "register_quantized_kv_attention", "quantize_kv"]


def __getattr__(name):
    if name in ("QuantizedKVCache", "QuantizedKVLayer", "KVStore"):
        from . import cache
        return getattr(cache, name)
    raise AttributeError(f"module 'torchqkit.kvcache' has no attribute {name!r}")
