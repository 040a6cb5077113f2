"""Attention that reads only the filled positions of a static KV cache: see Note [Filled-cache attention]."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import choose_backend  # importing kernels defines the op and loads its C++ CPU kernel

__all__ = ["FILLED_CACHE_MIN_LENGTH", "FILLED_CACHE_SDPA", "filled_cache_pays", "filled_cache_sdpa",
           "register_filled_cache_sdpa"]

FILLED_CACHE_SDPA = "torchqkit_filled_cache_sdpa"
_OP = "torchqkit::sdpa_over_filled_cache"
# Cache lengths from which the op pays, by the backend that serves it (kernels.choose_backend), measured per call at
# SmolLM2's shapes (9 x 64 query heads, 3 K/V heads, 46 filled positions, 1 thread;
# `python -m benchmarks decode --attention-calls --max-length 64,255,512,2048 --threads 1`):
#   "cpu" (the C++ kernel): ~4-6 us per call whatever the cache length, less than sdpa over the whole cache at every
#       length (16 us at 64 positions on a quiet host; at 8, 16 and 46 positions, 4-6 us against sdpa's 50-60 us on
#       a loaded one): always.
#   "reference" (the Python kernel: numpy on the mask, slicing, sdpa): ~33-38 us per call, sdpa over the whole cache
#       22 / 40 / 71 / 270 us at 64 / 256 / 512 / 2048 positions: from 256 on.
FILLED_CACHE_MIN_LENGTH = {"cpu": 2, "reference": 256}

# Note [Filled-cache attention]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A StaticCache holds max_length positions so that every decode step has the same shapes (one compiled graph).
# transformers' sdpa attention then attends over all of them under a mask that hides the unfilled ones, so a
# step reads and multiplies K and V of max_length positions whatever the prompt: SmolLM2-135M int4 decoded at
# 8.5 ms/token with max_length 64, 15.4 with 512 and 27.4 with 2048 (a 14-token prompt, 33 tokens). The op
# torchqkit::sdpa_over_filled_cache (kernels/ops/sdpa_over_filled_cache.py) takes the same inputs as that
# attention, finds the last position the mask lets any query see and attends over K[:, :, :n], V[:, :, :n] and
# the mask's first n columns: the same result (the cut positions had zero weight), with a cost that follows the
# filled length. The cut is a data-dependent length, which is why it is a custom op: the compiled step keeps its
# static shapes and the op slices at run time. On CPU its C++ kernel (csrc/cpu/decode_attention*.cpp) finds n and
# attends in one call of a few microseconds, cheaper than sdpa over any cache; the Python reference (other
# devices, or no C++ extension) costs more than it saves on short caches: FILLED_CACHE_MIN_LENGTH per backend.


def filled_cache_pays(max_length: int, device) -> bool:
    """Whether attention over the filled positions is cheaper than sdpa over a `max_length` cache on `device`, by the
    backend that serves the op there (FILLED_CACHE_MIN_LENGTH)."""
    backend, _ = choose_backend(_OP, device)
    return max_length >= FILLED_CACHE_MIN_LENGTH.get(backend, FILLED_CACHE_MIN_LENGTH["reference"])


def filled_cache_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function (AttentionInterface): sdpa over the filled cache positions.
    Without a mask (every key position is visible) it is plain sdpa, causal when several queries come at once."""
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__}: the filled-cache attention of LeanDecoder does not take "
                             f"`{name}`; build the LeanDecoder with filled_cache_attention=False")
    if dropout:
        raise ValueError(f"{type(module).__name__}: attention dropout {dropout} while decoding; call model.eval()")
    enable_gqa = query.shape[1] != key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is None:
        causal = query.shape[2] > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale, enable_gqa=enable_gqa)
    else:
        out = torch.ops.torchqkit.sdpa_over_filled_cache(query, key, value, attention_mask, scale, enable_gqa)
    return out.transpose(1, 2).contiguous(), None


def register_filled_cache_sdpa() -> str:
    """Register the attention function (and sdpa's mask) with transformers under FILLED_CACHE_SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FILLED_CACHE_SDPA, filled_cache_sdpa)
    AttentionMaskInterface.register(FILLED_CACHE_SDPA, sdpa_mask)
    return FILLED_CACHE_SDPA
