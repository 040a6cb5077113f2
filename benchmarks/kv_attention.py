"""python -m benchmarks.kv_attention: milliseconds per call of the quantized KV cache's two kernels on one SmolLM2
layer's shapes (9 query heads, 3 K / V heads of 64, batch 1), next to the float32 attention the lean decoder runs.

    python -m benchmarks.kv_attention                         # positions 2048, 8192; decode and a 512-query prefill
    python -m benchmarks.kv_attention --lengths 2048 --threads 1 --rounds 5

Rows per cache length n:
  decode, 1 query     torchqkit::sdpa_quantized_kv_cache over n cached positions (int8 and int4 with per-channel
                      keys, float8 e4m3 per token; groups of 64), and torchqkit::sdpa_over_filled_cache over a float32
                      static cache of n positions (the lean decoder's float attention)
  prefill, 512 queries  the same op with the last 512 positions (or all n, if fewer) as queries (causal), and
                      torch's sdpa on float32
  append, 1 position  torchqkit::kv_cache_append of one new position after n + 9 (keys and values: a typical
                      decode step, whose per-channel key block does not fill), the C++ CPU kernel where it is built,
                      beside the op's Python reference (kernels.reference)
Every way runs in each round (rounds interleave the ways, so a slow spell of a shared host hits them all), a round
times --calls calls; the table gives the median of the rounds' per-call times. Inputs are random N(0, 1) values
appended through the op itself. The machine should be otherwise idle.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.kvcache import KVCacheConfig
from torchqkit.kvcache.cache import KVStore

HQ, HKV, D = 9, 3, 64
CONFIGS = {"int8, per-channel keys": KVCacheConfig("int8", key_granularity="channel"),
           "int4, per-channel keys": KVCacheConfig("int4", key_granularity="channel"),
           "float8_e4m3fn, per token": KVCacheConfig("float8_e4m3fn")}


def _store(states, cfg, per_channel):
    store = KVStore.empty(1, HKV, D, states.shape[2] + 64, cfg, per_channel, "cpu")
    torch.ops.torchqkit.kv_cache_append(store.codes, store.scale, store.zero, store.tail, store.counts, states,
                                        cfg.dtype, cfg.group_size, per_channel, cfg.residual_length, "bench")
    return store


def _attention(q, ks, vs, cfg):
    args = (q, ks.codes, ks.scale, ks.zero, ks.tail, ks.counts, vs.codes, vs.scale, vs.zero, vs.tail, vs.counts, None,
            0.125, True, cfg.dtype, cfg.group_size, cfg.key_per_channel, cfg.dtype, cfg.group_size)
    return lambda: torch.ops.torchqkit.sdpa_quantized_kv_cache(*args)


def _append(cfg, n, reference: bool):
    """One position appended to a store holding n + 9 (reset before each call: counts only, the bytes stay): with
    per-channel keys a typical step, whose block of 64 does not fill (1 step in 64 quantizes the block)."""
    from torchqkit.kernels import reference as ref

    fn = getattr(ref, "kv_cache_append_ref", None) if reference else torch.ops.torchqkit.kv_cache_append
    if fn is None:
        return None
    states = torch.randn(1, HKV, n + 9, D)
    new = torch.randn(1, HKV, 1, D)
    stores = [_store(states, cfg, per_channel) for per_channel in (cfg.key_per_channel, False)]
    counts = [s.counts.clone() for s in stores]

    def call():
        for store, before, per_channel in zip(stores, counts, (cfg.key_per_channel, False)):
            store.counts.copy_(before)
            fn(store.codes, store.scale, store.zero, store.tail, store.counts, new, cfg.dtype, cfg.group_size,
               per_channel, cfg.residual_length, "bench")
    return call


def ways(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g)
    out = {}
    for lq, kind in ((1, "decode, 1 query"), (min(512, n), f"prefill, {min(512, n)} queries")):
        q = torch.randn(1, lq, HQ, D, generator=g).transpose(1, 2)  # transformers' memory order
        for name, cfg in CONFIGS.items():
            out[(kind, f"quantized KV, {name}")] = _attention(q, _store(k, cfg, cfg.key_per_channel),
                                                              _store(v, cfg, False), cfg)
        if lq == 1:
            kf, vf = torch.zeros(1, HKV, n + 64, D), torch.zeros(1, HKV, n + 64, D)
            kf[:, :, :n], vf[:, :, :n] = k, v
            mask = torch.zeros(1, 1, 1, n + 64, dtype=torch.bool)
            mask[..., :n] = True
            out[(kind, "float32 static cache, sdpa_over_filled_cache")] = (
                lambda q=q, kf=kf, vf=vf, mask=mask: torch.ops.torchqkit.sdpa_over_filled_cache(q, kf, vf, mask,
                                                                                               0.125, True))
        else:
            # the queries are the last lq positions: query l sees [0, n - lq + l] (is_causal would align them first)
            causal = torch.ones(lq, n, dtype=torch.bool).tril(n - lq)
            out[(kind, "float32, torch sdpa (causal)")] = (
                lambda q=q, causal=causal: F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=0.125,
                                                                          enable_gqa=True))
    for name, cfg in CONFIGS.items():
        for reference in (False, True):
            fn = _append(cfg, n, reference)
            if fn is not None:
                way = "Python reference" if reference else "op (C++ CPU kernel)"
                out[("append, 1 position", f"{name}, {way}")] = fn
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per way (default 7)")
    parser.add_argument("--calls", type=int, default=20, help="calls per round (default 20; prefill rows: 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = next(r["path"] for r in qk.kernels.status() if r["linear"] == "torchqkit::sdpa_quantized_kv_cache")
    lines = [f"quantized KV cache kernels, SmolLM2 layer shapes; torch {torch.__version__}, torchqkit "
             f"{qk.__version__}, {torch.get_num_threads()} threads; attention path: {path}",
             f"command: python -m benchmarks.kv_attention --lengths {','.join(map(str, args.lengths))} --rounds "
             f"{args.rounds} --calls {args.calls}" + (f" --threads {args.threads}" if args.threads else ""),
             "", "| positions | call | way | ms per call |", "|---|---|---|---:|"]
    print("\n".join(lines), flush=True)
    for n in args.lengths:
        table = ways(n)
        times = {key: [] for key in table}
        for _ in range(args.rounds):
            for key, fn in table.items():
                calls = max(1, args.calls // 10) if key[0].startswith("prefill") else args.calls
                fn()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[key].append((time.perf_counter() - start) / calls)
        for (kind, way), values in times.items():
            lines.append(f"| {n} | {kind} | {way} | {1e3 * statistics.median(values):.4g} |")
            print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
