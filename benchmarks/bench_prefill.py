"""SmolLM2-135M prompt processing (prefill) tokens/s: llama.cpp next to torchqkit, every Linear and the tied lm_head
quantized as in bench_decode.py.

    python benchmarks/bench_prefill.py                                       # 128- and 512-token prompts
    python benchmarks/bench_prefill.py --configs float32,int4-g32-q41-int8-act --prompt-tokens 256
    TORCHQKIT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/bench_prefill.py --peer-python PEERS_AVX2_VENV/bin/python   # a laptop's AVX2

A prefill is one forward over the prompt's N tokens as a batch (M = N rows in every Linear: the prefill kernels,
not the decode ones), eager, under inference_mode, computing the logits of the last position only
(logits_to_keep=1), as generate() does and as llama.cpp's prompt evaluation does; the KV cache is filled as in a
real prompt. The prompt is the first N tokens of the text torchqkit ships (torchqkit.eval.eval_text); llama.cpp
(peer_llama_cpp.py --prefill-tokens, in --peer-python's venv: a peer, never a dependency) takes the first N tokens
of its own tokenization of the same text, as one batch of N. tokens/s = N / the median of --repeats timed prefills
after a warm-up, each config's rounds alternating with the others' (a shared host's slow spells hit every config).
llama.cpp runs before and after torchqkit's rows; 'x llama.cpp' is against the mean of the two. (llama-cpp-python
0.3.36 built on a Xeon with AMX segfaulted on prompt batches of 2 or more tokens, peer_llama_cpp.py: its line then
says 'failed' and torchqkit's rows still print.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402  (CONFIGS, quantized_copy, llama_cpp_simd)
import bench_linear  # noqa: E402  (read_bandwidth, cpu_model)
import bench_model  # noqa: E402  (machine line)
from torchqkit.eval import eval_text, load_gguf, smollm2_gguf_path  # noqa: E402

DEFAULT_CONFIGS = ("float32", "int4-g32-bf16-scales", "int4-g128", "int4-g32-q41-int8-act",
                   "int4-g32-q41-int8-act-g32")


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, of {', '.join(bench_decode.CONFIGS)} (+fused as in bench_decode.py)")
    p.add_argument("--prompt-tokens", default="128,512", help="comma-separated prompt lengths")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills per row, median (default: 5)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-python", default=bench_decode.PEER_PYTHON, help="a Python with llama-cpp-python "
                                                                           "('' to skip)")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if bench_decode.base_config(c) not in bench_decode.CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {', '.join(bench_decode.CONFIGS)}")
    args.prompt_tokens = [int(n) for n in args.prompt_tokens.split(",") if n]
    if not args.prompt_tokens or min(args.prompt_tokens) < 1:
        p.error("--prompt-tokens: positive lengths")
    return args


def prompt_text(tokens: int) -> str:
    """A prefix of the shipped text long enough for `tokens` tokens in either tokenizer (about 4 characters each)."""
    return eval_text()[:16 * tokens]


def llama_cpp_prefill(args, gguf: Path, tokens: int) -> dict:
    if not args.peer_python:
        return {"note": "skipped (--peer-python '')"}
    if not Path(args.peer_python).is_file():
        return {"note": f"no Python at {args.peer_python} (a venv with llama-cpp-python)"}
    script = Path(__file__).resolve().parent / "peer_llama_cpp.py"
    cmd = [args.peer_python, str(script), str(gguf), "--prompt", prompt_text(tokens), "--prefill-tokens", str(tokens),
           "--threads", str(args.threads), "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"note": f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"}
    return json.loads(done.stdout)


def prefill_seconds(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, logits_to_keep=1, use_cache=True)
        return time.perf_counter() - start


def main(argv=None) -> int:
    args = _parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    gguf = smollm2_gguf_path()
    peer_before = {n: llama_cpp_prefill(args, gguf, n) for n in args.prompt_tokens}
    base, tokenizer = load_gguf(gguf)
    models = {}
    for name in args.configs:
        print(f"[bench_prefill] quantizing {name}", file=sys.stderr, flush=True)
        models[name] = bench_decode.quantized_copy(base, name)[0]
    bandwidth = bench_linear.read_bandwidth()
    seconds = {(name, n): [] for name in models for n in args.prompt_tokens}
    for n in args.prompt_tokens:
        ids = tokenizer(prompt_text(n), return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] < n:
            raise SystemExit(f"the text gave {ids.shape[1]} tokens, fewer than {n}")
        for model in models.values():
            prefill_seconds(model, ids)  # warm-up
        names = list(models)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds[name, n].append(prefill_seconds(models[name], ids))
    peer_after = {n: llama_cpp_prefill(args, gguf, n) for n in args.prompt_tokens}

    print(f"machine: {bench_model.machine()}; CPU {bench_linear.cpu_model()}")
    print(f"ISA: TORCHQKIT_CPU_ISA={os.environ.get('TORCHQKIT_CPU_ISA', '(auto)')}, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; read bandwidth {bandwidth:.1f} GB/s (this run); {args.threads} "
          f"threads; median of {args.repeats} prefills, eager, logits of the last position only")
    peer_tok_s = {}
    for n in args.prompt_tokens:
        before, after = peer_before[n], peer_after[n]
        if "tok_s" in before and "tok_s" in after:
            peer_tok_s[n] = (before["tok_s"] + after["tok_s"]) / 2
            print(f"llama.cpp (llama-cpp-python {before['version']}, built for "
                  f"{bench_decode.llama_cpp_simd(before['system_info'])}; {gguf.name}), {n}-token prompt: "
                  f"{before['tok_s']:.0f} tok/s before torchqkit's rows, {after['tok_s']:.0f} after")
        else:
            print(f"llama.cpp, {n}-token prompt: {before.get('note') or after.get('note')}")
    header = f"{'config':<30}" + "".join(f" {f'{n} tok: tok/s':>15} {'x llama.cpp':>12}" for n in args.prompt_tokens)
    print(header)
    for name in models:
        line = f"{name:<30}"
        for n in args.prompt_tokens:
            tok_s = n / statistics.median(seconds[name, n])
            ratio = f"{tok_s / peer_tok_s[n]:.2f}x" if n in peer_tok_s else "-"
            line += f" {tok_s:15.0f} {ratio:>12}"
        print(line)
    print(f"wall time {time.perf_counter() - start:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
