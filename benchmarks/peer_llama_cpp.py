"""Greedy decode tokens/s of llama.cpp (through llama-cpp-python) on a GGUF file, as JSON on stdout; with
--prefill-tokens N, its prompt processing instead: N tokens of --prompt evaluated as one batch.

Run as a script by the decode and prefill groups (benchmarks/common/peers.py) with the Python of a venv where
llama-cpp-python is installed (--peers-python), never imported by torchqkit or the benchmarks package (llama.cpp is a
peer to measure against, not a dependency), so it stays a standalone file:

    PEERS_VENV/bin/python benchmarks/peer_llama_cpp.py FILE.gguf --prompt "..." --new-tokens 32 --threads 2

Timing matches torchqkit.eval's Note [Decode timing]: the time at which each new token exists, the first
one from the prefill; rate = (new_tokens - 1) / (last - first), median of --repeats runs after a warm-up.
Greedy: llama.cpp's sampler with top_k=1 (argmax), no repetition penalty.

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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=0)
    args = parser.parse_args()
    import llama_cpp

    if args.prefill_tokens:
        return prefill(args, llama_cpp)

    # n_batch = 1: the prompt goes in one token at a time. llama-cpp-python 0.3.36 built on a Xeon with AMX
    # segfaulted on any prompt batch of 2 or more tokens (its AMX path); decode steps are single tokens either way,
    # and only they are timed.
    llm = llama_cpp.Llama(args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512, n_batch=1,
                          n_ubatch=1, verbose=False)
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
    json.dump({"version": llama_cpp.__version__, "prompt_tokens": prompt,
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
