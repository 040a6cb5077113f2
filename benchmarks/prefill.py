"""LLM prompt processing (prefill) tokens/s: llama.cpp next to torchqkit, every Linear and the tied lm_head quantized
as in the decode group.

    python -m benchmarks prefill                                      # 128- and 512-token prompts
    python -m benchmarks prefill --configs float32,int8-dyn-int4-q41 --prompt-tokens 256
    TORCHQKIT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python -m benchmarks prefill --peers-python PEERS_AVX2_VENV/bin/python   # a laptop's AVX2

A prefill is one forward over the prompt's N tokens as a batch (M = N rows in every Linear: the prefill kernels),
eager, under inference_mode, computing the logits of the last position only (logits_to_keep=1) as generate() and
llama.cpp's prompt evaluation do; the KV cache is filled as in a real prompt. The prompt is the first N tokens of the
text torchqkit ships; llama.cpp (peer_llama_cpp.py --prefill-tokens, in --peers-python's venv) takes the first N tokens
of its own tokenization of the same text, as one batch. tokens/s = N / the median of --repeats timed prefills after a
warm-up, each config's prefills alternating with the others' (a shared host's slow spells hit every config alike).
llama.cpp runs before and after torchqkit's rows; 'x llama.cpp' is against the mean of the two.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from torchqkit.eval import eval_text

from .common import cli, llm, peers
from .common.memory import QUICK_BYTES, read_bandwidth
from .decode import config_of, quantized_copy

GROUP = "prefill"
DEFAULT_CONFIGS = ["float32", "int4-wo-g32-bf16-scales", "int4-wo-g128", "int8-dyn-int4-q41", "int8-dyn-g32-int4-q41"]


def prompt_text(tokens: int) -> str:
    """A prefix of the shipped text long enough for `tokens` tokens in either tokenizer (about 4 characters each)."""
    return eval_text()[:16 * tokens]


def prefill_seconds(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, logits_to_keep=1, use_cache=True)
        return time.perf_counter() - start


def peer_runs(args, gguf) -> dict:
    return {n: peers.run(args.peers_python, gguf, "--prompt", prompt_text(n), "--prefill-tokens", str(n), "--threads",
                         str(torch.get_num_threads()), "--repeats", str(args.repeats)) for n in args.prompt_tokens}


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--prompt-tokens", default="128,512", help="comma-separated prompt lengths")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills per row, median (default: 5)")
    peers.add_option(p)
    p.set_defaults(threads=2)
    args, rec = cli.start(GROUP, p, argv, config_of)
    cli.quick(args, argv, repeats=1, prompt_tokens="32", configs=["float32", "int4-wo-g32"])
    args.prompt_tokens = [int(n) for n in args.prompt_tokens.split(",") if n]
    if not args.prompt_tokens or min(args.prompt_tokens) < 1:
        p.error("--prompt-tokens: positive lengths")
    model_llm = llm.load(args.quick)
    before = peer_runs(args, model_llm.gguf)
    models = {}
    for name in args.configs:
        print(f"[prefill] quantizing {name}", file=sys.stderr, flush=True)
        models[name] = quantized_copy(model_llm.model, name)[0]
    rec.read_bw_gbs = read_bandwidth(nbytes=QUICK_BYTES) if args.quick else read_bandwidth()
    seconds = {(name, n): [] for name in models for n in args.prompt_tokens}
    for n in args.prompt_tokens:
        ids = model_llm.tokenize(prompt_text(n))[:n].unsqueeze(0)
        if ids.shape[1] < n:
            raise SystemExit(f"the text gave {ids.shape[1]} tokens, fewer than {n}")
        for model in models.values():
            prefill_seconds(model, ids)  # warm-up
        names = list(models)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds[name, n].append(prefill_seconds(models[name], ids))
    after = peer_runs(args, model_llm.gguf) if any("tok_s" in v for v in before.values()) else {}
    for n in args.prompt_tokens:
        shape = {"model": model_llm.name, "prompt_tokens": n}
        peer = [r["tok_s"] for r in (before[n], after.get(n, {})) if "tok_s" in r]
        for when, r in (("before", before[n]), ("after", after.get(n, {}))):
            if "tok_s" in r:
                rec.add(f"llama.cpp {when}", "llama.cpp", shape, "prefill", r["tok_s"], "tok/s", version=r["version"],
                        simd=peers.simd(r["system_info"]))
        if not peer:
            print(f"llama.cpp, {n}-token prompt: {before[n].get('note')}")
        for name in models:
            tok_s = n / statistics.median(seconds[name, n])
            rec.add("eager, inference_mode", name, shape, "prefill", tok_s, "tok/s")
            if peer:
                rec.add("eager, inference_mode", name, shape, "x llama.cpp", tok_s / (sum(peer) / len(peer)), "x")
    rec.print_table()
    return 0
