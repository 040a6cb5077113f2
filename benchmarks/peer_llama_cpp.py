"""Greedy decode tokens/s of llama.cpp (through llama-cpp-python) on a GGUF file, as JSON on stdout; with
--prefill-tokens N, its prompt processing instead: N tokens of --prompt evaluated as one batch.

Run as a script by the decode and prefill groups (benchmarks/common/peers.py) with the Python of a venv where
llama-cpp-python is installed (--peers-python), never imported by torchqkit or the benchmarks package (llama.cpp is a
peer to measure against, not a dependency), so it stays a standalone file:

    PEERS_VENV/bin/python benchmarks/peer_llama_cpp.py FILE.gguf --prompt "..." --new-tokens 32 --threads 2

Timing matches torchqkit.eval's Note [Decode timing]: the time at which each new token exists, the first
one from the prefill; rate = (new_tokens - 1) / (last - first), median of --repeats runs after a warm-up.
Greedy: llama.cpp's sampler with top_k=1 (argmax), no repetition penalty.

--context N sets the context length (default 512) and --cache-type the KV cache's type (f16, llama.cpp's default, or
q8_0 / q4_0: quantized keys and values, which llama.cpp runs with flash attention only, so it is switched on for
them); with --prompt-ids the prompt is those token ids (a file of comma-separated ids: the KV cache benchmark's long
prompts, the same ids torchqkit decodes after) and --batch tokens go in per prompt step.

Prefill (the prefill group): the first N prompt tokens through Llama.eval with n_batch = n_ubatch = N (one batch, the
logits of the last position only, as a generate call computes them), after llm.reset(); rate = N / the median
wall time of --repeats evals after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # llama.cpp's GGML_TYPE_* numbers


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--prompt", default=None, help="the prompt text (or --prompt-ids)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=0)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--cache-type", choices=sorted(CACHE_TYPES), default="f16")
    parser.add_argument("--prompt-ids", default=None, help="a file of comma-separated token ids instead of --prompt")
    parser.add_argument("--batch", type=int, default=1, help="prompt tokens per llama.cpp batch (decode: 1)")
    args = parser.parse_args()
    if (args.prompt is None) == (args.prompt_ids is None):
        parser.error("give --prompt or --prompt-ids (one of them)")
    if args.prefill_tokens and args.prompt_ids:
        parser.error("--prefill-tokens reads --prompt text, not --prompt-ids")
    import llama_cpp

    if args.prefill_tokens:
        return prefill(args, llama_cpp)

    # n_batch = 1: the prompt goes in one token at a time. llama-cpp-python 0.3.36 built on a Xeon with AMX
    # segfaulted on any prompt batch of 2 or more tokens (its AMX path); decode steps are single tokens either way,
    # and only they are timed.
    cache = CACHE_TYPES[args.cache_type]
    llm = llama_cpp.Llama(args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=args.context,
                          n_batch=args.batch, n_ubatch=args.batch, type_k=cache, type_v=cache,
                          flash_attn=args.cache_type != "f16", verbose=False)
    if args.prompt_ids:
        with open(args.prompt_ids) as f:
            prompt = [int(t) for t in f.read().split(",") if t.strip()]
    else:
        prompt = llm.tokenize(args.prompt.encode(), add_bos=False)

    def run() -> tuple[list[float], list[int]]:
        llm.reset()
        times, tokens = [], []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == args.new_tokens:
                break
        return times, tokens

    run()
    durations, tokens = [], []
    for _ in range(args.repeats):
        times, tokens = run()
        durations.append(times[-1] - times[0])
    json.dump({"version": llama_cpp.__version__, "prompt_tokens": prompt if len(prompt) <= 64 else len(prompt),
               "cache_type": args.cache_type, "context": args.context,
               "tok_s": (args.new_tokens - 1) / statistics.median(durations), "tokens": tokens,
               "system_info": llama_cpp.llama_print_system_info().decode()}, sys.stdout)
    return 0


def prefill(args, llama_cpp) -> int:
    n = args.prefill_tokens
    llm = llama_cpp.Llama(args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=n + 16, n_batch=n,
                          n_ubatch=n, verbose=False)
    prompt = llm.tokenize(args.prompt.encode(), add_bos=False)[:n]
    if len(prompt) < n:
        raise SystemExit(f"the prompt has {len(prompt)} tokens, fewer than --prefill-tokens {n}")

    def run() -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    run()
    seconds = statistics.median(run() for _ in range(args.repeats))
    json.dump({"version": llama_cpp.__version__, "prefill_tokens": n, "tok_s": n / seconds,
               "system_info": llama_cpp.llama_print_system_info().decode()}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
