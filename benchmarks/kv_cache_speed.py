"""python -m benchmarks.kv_cache_speed: decode tokens/s of SmolLM2-135M with a long context in a float or quantized
KV cache, next to llama.cpp with an f16 and a q8_0 KV cache on the same GGUF file.

    python -m benchmarks.kv_cache_speed --lengths 2048,8192 --peers-python LLAMA_CPP_VENV/bin/python
    python -m benchmarks.kv_cache_speed --lengths 256 --new-tokens 9 --repeats 1     # a quick check that it runs

For each length L the prompt is L - --new-tokens tokens of torchqkit's eval text (repeated where the text is
shorter), then --new-tokens tokens are decoded greedily, so the last step reads L - 1 cached positions. torchqkit:
SmolLM2's Q4_1 file dequantized and quantized again with the `int4-wo-g32-out8` preset (int4 g32 Linears rebuild the
file's Q4_1 weights exactly; the tied output layer at int8 per row), decoded by the lean loop
(torchqkit.eval.decode_tokens_per_second: prefill excluded, Note [Decode timing]) with a float32 static cache and with
each KVCacheConfig below. llama.cpp (peer_llama_cpp.py in --peers-python's venv, the same prompt ids, the same thread
count) decodes the same file with its default f16 cache and with q8_0 keys and values (flash attention on, as
llama.cpp requires for a quantized V cache). The torchqkit rows of one length run in --rounds rounds, the caches in
turn, and each gives its median rate and the median of its per-round ratios to the float32 cache (a shared host's
speed drifts by 10% from minute to minute, more than the differences measured); the machine should be otherwise
idle.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

import torchqkit as qk
from torchqkit.eval import decode_tokens_per_second, eval_text, load_gguf, smollm2_gguf_path

from .common import peers
from .decode import quantized_copy

CACHES = {  # row name -> KVCacheConfig (None: the lean loop's float32 static cache)
    "float32 static cache": None,
    "int8 per-channel keys, per-token values": qk.KVCacheConfig("int8", key_granularity="channel"),
    "int4 per-channel keys, per-token values, residual 128": qk.KVCacheConfig(
        "int4", key_granularity="channel", residual_length=128),
}
PEER_CACHES = ("f16", "q8_0")
CONFIG = "int4-wo-g32-out8"


def _prompt(ids: torch.Tensor, n: int) -> torch.Tensor:
    reps = -(-n // ids.numel())
    return ids.repeat(reps)[:n]


def _rows(model, ids, args):
    threads = torch.get_num_threads()
    gguf = smollm2_gguf_path()
    for length in args.lengths:
        prompt = _prompt(ids, length - args.new_tokens)
        rates = {name: [] for name in CACHES}
        for _ in range(args.rounds):  # the caches in turn, so a slow minute of a shared host hits every row alike
            for name, cfg in CACHES.items():
                rates[name].append(decode_tokens_per_second(model, prompt, args.new_tokens, args.repeats,
                                                            compile=args.compile, kv_cache=cfg))
        base = rates["float32 static cache"]
        for name in CACHES:
            ratio = statistics.median(r / b for r, b in zip(rates[name], base))
            yield (length, f"torchqkit {CONFIG}, {name}", f"{statistics.median(rates[name]):.1f}",
                   f"{ratio:.3f}x")
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write(",".join(str(int(t)) for t in prompt))
        try:
            for cache in PEER_CACHES:
                out = peers.run(args.peers_python, gguf, "--prompt-ids", f.name, "--context",
                                str(length), "--cache-type", cache, "--new-tokens", str(args.new_tokens),
                                "--repeats", str(args.repeats), "--threads", str(threads), "--batch",
                                str(args.peer_batch))
                rate = f"{out['tok_s']:.1f}" if "tok_s" in out else out["note"]
                yield length, f"llama.cpp {out.get('version', '')}, {cache} KV cache", rate, "-"
        finally:
            os.unlink(f.name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192],
                        help="cache positions at the last decode step (default 2048,8192)")
    parser.add_argument("--new-tokens", type=int, default=33, help="tokens decoded per run (default 33)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row, median (default 3)")
    parser.add_argument("--compile", action="store_true", help="compile the lean loop's step")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the torchqkit rows, the caches in turn; each row gives the median round and "
                             "the median of its per-round ratios to the float32 cache (default 3)")
    parser.add_argument("--peer-batch", type=int, default=512,
                        help="prompt tokens per llama.cpp batch (default 512; 1 on a Xeon with AMX, where "
                             "llama-cpp-python 0.3.36 crashed on larger batches)")
    peers.add_option(parser)
    args = parser.parse_args(argv)
    if min(args.lengths) <= args.new_tokens + 1:
        parser.error(f"--lengths must exceed --new-tokens + 1 = {args.new_tokens + 1}")
    # Each run builds a new decoder and cache, whose step the compiled loop specializes on (guards on the cache's
    # objects): every run of every length is one compile of the same code, more than dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               2 * args.rounds * len(CACHES) * len(args.lengths))
    model, tokenizer = load_gguf(smollm2_gguf_path())
    model.eval()
    model, _ = quantized_copy(model, CONFIG)
    ids = tokenizer(eval_text(), return_tensors="pt", verbose=False).input_ids[0]
    lines = [f"SmolLM2-135M, decode tokens/s after a long prompt; torch {torch.__version__}, torchqkit "
             f"{qk.__version__}, {torch.get_num_threads()} threads",
             f"command: python -m benchmarks.kv_cache_speed --lengths {','.join(map(str, args.lengths))} "
             f"--new-tokens {args.new_tokens} --repeats {args.repeats} --rounds {args.rounds}"
             + (" --compile" if args.compile else ""),
             "", "| positions | decoder, cache | decode tokens/s | vs the float32 cache |", "|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for length, name, rate, ratio in _rows(model, ids, args):
        lines.append(f"| {length} | {name} | {rate} | {ratio} |")
        print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
