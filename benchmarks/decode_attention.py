"""decode --attention-calls: microseconds per call of one SmolLM2 layer's decode attention (batch 1, one query, 9 x 64
query heads, 3 K/V heads, 46 of S positions filled, the bool mask transformers builds), for each --max-length S, the
three ways interleaved in rounds so a shared host's slow spells hit all three: torchqkit::sdpa_over_filled_cache, its
Python reference, and sdpa over the whole cache."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from torchqkit.kernels.reference import sdpa_over_filled_cache_ref

FILLED = 46


def ways():
    return {"torchqkit::sdpa_over_filled_cache": torch.ops.torchqkit.sdpa_over_filled_cache,
            "reference": sdpa_over_filled_cache_ref,
            "whole-cache sdpa": lambda q, k, v, m, s, g: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=s,
                                                                                        enable_gqa=g)}


def run(args, rec) -> int:
    rounds, calls = (2, 20) if args.quick else (7 * args.repeats, 200)
    for length in [n or 64 for n in args.max_length]:
        q = torch.randn(1, 1, 9, 64).transpose(1, 2)  # (B, Lq, H, D) memory, as transformers' query
        k, v = torch.randn(1, 3, length, 64), torch.randn(1, 3, length, 64)
        mask = torch.zeros(1, 1, 1, length, dtype=torch.bool)
        mask[..., :FILLED] = True
        fns = ways()
        times = {w: [] for w in fns}
        with torch.inference_mode():
            for fn in fns.values():  # warm-up: first-call allocations, caches
                for _ in range(calls):
                    fn(q, k, v, mask, 0.125, True)
            for _ in range(rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn(q, k, v, mask, 0.125, True)
                    times[name].append((time.perf_counter() - t0) / calls * 1e6)
        shape = {"heads": 9, "kv_heads": 3, "head_dim": 64, "positions": length, "filled": FILLED}
        for name, t in times.items():
            rec.add(name, "float32", shape, "attention call", statistics.median(t), "us")
    rec.print_table()
    return 0
