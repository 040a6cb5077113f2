"""LLM greedy decode tokens/s: llama.cpp next to torchqkit (float32 and each config, every Linear and the lm_head
quantized, the lm_head still tied to the embedding), through HF generate() and the lean loop (torchqkit.eval's
LeanDecoder), eager and compiled, with the per-token breakdown of each row.

    python -m benchmarks decode                                       # every row, 2 threads
    python -m benchmarks decode --quick                               # a tiny random LLaMA, eager loops (seconds)
    python -m benchmarks decode --configs int4-wo-g32 --loops lean-compiled --inductor '{"freezing": true}'
    TORCHQKIT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks decode
    python -m benchmarks decode --configs int4-wo-g128 --loops lean-compiled --ppl-tokens 0 \\
        --max-length 64,255,2048 --filled-cache on,off               # attention over the filled positions or not
    python -m benchmarks decode --attention-calls --max-length 64,255,512,2048 --threads 1   # one layer's call
    python -m benchmarks decode --alternate --configs int4-wo-g32,int4-wo-g32+fused --repeats 15   # side by side

A --configs entry is a preset (or `<preset>+<change>`), optionally followed by procedure suffixes: `+fused` also
fuses the q/k/v and gate/up projections after quantizing (qk.fuse_shared_input_linears), then `+python-wrapper`
compiles that row's step with inductor's Python wrapper (LeanDecoder's CPU default is the C++ one).

llama.cpp runs in a subprocess (--peers-python: a venv with llama-cpp-python; peer_llama_cpp.py) on the same GGUF
file (SmolLM2's Q4_1) with the same prompt, thread count and timing rule (Note [Decode timing] in
torchqkit/eval/speed.py), once before torchqkit's rows and once after: each row's "x llama.cpp" is against the mean of
the two (on a shared host llama.cpp alone moved 99-137 tok/s between runs minutes apart). torchqkit's model is that
file dequantized to float32 by transformers, then quantized by torchqkit (round to nearest), channels NOT permuted:
int4-wo-g32 then reproduces the file's own Q4_1 weights exactly, the same weights llama.cpp reads. The perplexity
(first --ppl-tokens tokens of the eval text) shows what a config costs, the lm_head included. Compile time is the
first compiled step (warm-up), never decode time.
"""
from __future__ import annotations

import json
import sys

import torch

import torchqkit as qk
from torchqkit.eval import DecodeLoop, decode_breakdown, eval_text, perplexity
from torchqkit.eval.filled_cache_attention import FILLED_CACHE_SDPA

from .common import cli, llm, peers
from .common.memory import QUICK_BYTES, read_bandwidth

GROUP = "decode"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
DEFAULT_CONFIGS = ["float32", "int4-wo-g32", "int4-wo-g128", "int4-wo-g32-bf16-scales", "int4-wo-g32+fp16-scales",
                   "int4-wo-g128+bf16-scales", "int8-wo", "int8-dyn-int4-q41", "int8-dyn-g32-int4-q41",
                   "int4-wo-g32-bf16-scales+tiles8"]
QUICK_CONFIGS = ["float32", "int4-wo-g32"]
FUSED, PY_WRAPPER = "+fused", "+python-wrapper"
LOOPS = ("generate", "lean-eager", "lean-compiled")
FILLED_CACHE = {"auto": None, "on": True, "off": False}


def config_of(name: str) -> str:
    """The config under a --configs entry's procedure suffixes."""
    return name.removesuffix(PY_WRAPPER).removesuffix(FUSED)


def inductor_options(name: str, args) -> dict:
    return {**args.inductor, "cpp_wrapper": False} if name.endswith(PY_WRAPPER) else args.inductor


def _args(argv):
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per run (default: 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row, median (default: 3)")
    p.add_argument("--matmul-precision", choices=("highest", "high", "medium"), default="highest",
                   help="torch.set_float32_matmul_precision for the run ('medium': float32 activations may take the "
                        "bf16 kernels on AVX512-BF16 CPUs; default highest, exact fp32)")
    p.add_argument("--inductor", default="{}", help="inductor options (JSON) of the compiled rows")
    p.add_argument("--max-length", default="", help="KV cache positions of the lean loops, comma-separated for "
                                                    "several rows (default: prompt + new tokens)")
    p.add_argument("--filled-cache", default="auto", help="lean loops' attention, comma-separated: auto, on "
                                                          "(torchqkit::sdpa_over_filled_cache), off (whole cache)")
    p.add_argument("--ppl-tokens", type=int, default=512, help="tokens scored for perplexity (0: skip)")
    p.add_argument("--alternate", action="store_true", help="compiled lean loops only, configs timed in turn per "
                                                            "round (decode_alternate.py)")
    p.add_argument("--attention-calls", action="store_true", help="only one layer's decode attention per call "
                                                                  "(decode_attention.py)")
    peers.add_option(p)
    p.set_defaults(threads=2)
    args, rec = cli.start(GROUP, p, argv, config_of)
    # --quick: eager loops only (compiling a step takes minutes)
    cli.quick(args, argv, new_tokens=4, repeats=1, ppl_tokens=32, configs=QUICK_CONFIGS, loops="generate,lean-eager")
    args.loops = [c for c in args.loops.split(",") if c]
    if sorted(set(args.loops) - set(LOOPS)):
        p.error(f"--loops: unknown {sorted(set(args.loops) - set(LOOPS))}; known: {', '.join(LOOPS)}")
    args.inductor = json.loads(args.inductor)
    try:
        args.max_length = [int(n) for n in args.max_length.split(",") if n] or [None]
    except ValueError:
        p.error(f"--max-length: comma-separated integers, got {args.max_length!r}")
    args.filled_cache = [m for m in args.filled_cache.split(",") if m]
    if not args.filled_cache or set(args.filled_cache) - set(FILLED_CACHE):
        p.error(f"--filled-cache: of {', '.join(FILLED_CACHE)}, got {args.filled_cache}")
    return args, rec


def quantized_copy(base, name: str):
    model, done = llm.quantized_copy(base, config_of(name))
    if name.removesuffix(PY_WRAPPER).endswith(FUSED):
        fused = qk.fuse_shared_input_linears(model)
        if set(fused.values()) != {"fused"}:
            raise RuntimeError(f"not every projection group fused: {fused}")
    return model, done


def measure(model, ids, loop_name, args, max_length, filled, inductor) -> dict:
    kwargs = {"decode": "generate"} if loop_name == "generate" else {
        "decode": "lean", "max_length": max_length, "filled_cache_attention": FILLED_CACHE[filled]}
    if loop_name == "lean-compiled":
        kwargs.update(compile=True, inductor_options=inductor)
    loop = DecodeLoop(model, ids, args.new_tokens, **kwargs)
    loop.run()  # warm-up; compiles the lean step
    parts = decode_breakdown(loop, repeats=args.repeats)
    attention = "-" if loop_name == "generate" else ("filled" if loop.attention == FILLED_CACHE_SDPA else "whole")
    return {"parts": parts, "tokens": loop.tokens, "compile_s": loop.compile_seconds,
            "replayed": loop_name == "lean-compiled" and not loop.replay_off,
            "cache": "-" if loop_name == "generate" else str(max_length or len(ids) + args.new_tokens),
            "attention": attention}


def variants(loop_name, args):
    """(max_length, filled-cache mode) of each row of a loop: one for generate, every pair for the lean loops."""
    return [(None, "auto")] if loop_name == "generate" else [(n, f) for n in args.max_length for f in args.filled_cache]


def record_row(rec, name, loop_name, model_name, row, mb, ppl, same):
    p = row["parts"]
    shape = {"model": model_name, "new_tokens": len(row["tokens"]), "cache": row["cache"],
             "attention": row["attention"]}

    def add(metric, value, unit):
        rec.add(loop_name, name, shape, metric, value, unit, same_as_generate=same, replayed=row["replayed"])

    add("decode", 1e3 / p.total, "tok/s")
    add("per token", p.total, "ms")
    for part, ms in p.kernels.items():
        add(f"per token: {part}", ms, "ms")
    add("per token: rest", p.rest, "ms")
    add("weights read per token", mb, "MB")
    add("weight read", mb / p.total, "GB/s")
    if row["compile_s"] is not None:
        add("compile", row["compile_s"], "s")
    if ppl is not None:
        add("perplexity", ppl, "")


def record_peer(rec, model_name, peer, when, args):
    shape = {"model": model_name, "new_tokens": args.new_tokens, "cache": "-", "attention": "-"}
    if "tok_s" in peer:
        rec.add(f"llama.cpp {when}", "llama.cpp", shape, "decode", peer["tok_s"], "tok/s",
                version=peer["version"], simd=peers.simd(peer["system_info"]))
    return peer.get("tok_s")


def main(argv=None) -> int:
    args, rec = _args(argv)
    torch.set_float32_matmul_precision(args.matmul_precision)
    if args.attention_calls:
        from . import decode_attention
        return decode_attention.run(args, rec)
    model_llm = llm.load(args.quick)
    if args.alternate:
        from . import decode_alternate
        return decode_alternate.run(args, rec, model_llm)
    base, name = model_llm.model, model_llm.name
    before = peers.run(args.peers_python, model_llm.gguf, "--prompt", PROMPT, "--new-tokens", str(args.new_tokens),
                       "--threads", str(torch.get_num_threads()), "--repeats", str(args.repeats))
    ids = model_llm.tokenize(PROMPT)
    text_ids = model_llm.tokenize(eval_text())[:args.ppl_tokens]
    rec.read_bw_gbs = read_bandwidth(nbytes=QUICK_BYTES) if args.quick else read_bandwidth()
    peer_tok_s = [record_peer(rec, name, before, "before", args)]
    for config in args.configs:
        model, _ = quantized_copy(base, config)
        ppl = perplexity(model, text_ids, window=len(text_ids), progress=False) if args.ppl_tokens > 1 else None
        reference = None
        for loop_name in args.loops:
            for max_length, filled in variants(loop_name, args):
                print(f"[decode] {config} {loop_name} cache {max_length or 'auto'} filled-cache {filled}",
                      file=sys.stderr, flush=True)
                row = measure(model, ids, loop_name, args, max_length, filled, inductor_options(config, args))
                reference = row["tokens"] if loop_name == "generate" else reference
                same = None if reference is None or loop_name == "generate" else row["tokens"] == reference
                record_row(rec, config, loop_name, name, row, llm.weight_mb_per_token(model), ppl, same)
        del model
        torch._dynamo.reset()  # each config compiles its own step; past 8, dynamo's recompile limit would refuse
    if "tok_s" in before:
        after = peers.run(args.peers_python, model_llm.gguf, "--prompt", PROMPT, "--new-tokens", str(args.new_tokens),
                          "--threads", str(torch.get_num_threads()), "--repeats", str(args.repeats))
        peer_tok_s.append(record_peer(rec, name, after, "after", args))
        known = [t for t in peer_tok_s if t]
        mean = sum(known) / len(known)
        for r in [r for r in rec.records if r["metric"] == "decode" and r["config"] != "llama.cpp"]:
            rec.add(r["case"], r["config"], r["shape"], "x llama.cpp", r["value"] / mean, "x")
    else:
        print(f"llama.cpp: {before['note']}")
    rec.print_table()
    return 0
