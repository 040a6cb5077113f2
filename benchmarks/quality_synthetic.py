"""The quality group's speed rows: decode tokens/s of a random LLaMA-shaped decoder (synthetic_decoder.py, ~0.5B
parameters; batch 1, KV cache) per config, eager and torch.compile; and all-MiniLM-L6-v2 encode throughput per config
through torchqkit's demo (64 sentences, batch 64), with the cosine of its embeddings to float32.

Each decoder row: a short prompt (prefill, not timed), then --steps decode steps of one token; tokens/s is steps / the
median wall time of --repeats decode loops after one warm-up loop. Activations are float32 for float32 and the
quantized configs, bfloat16 for the bfloat16 baseline."""
from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import torchqkit as qk

from . import synthetic_decoder
from .common.configs import BASELINES, build
from .common.llm import tensor_bytes


def decode_tokens_per_s(model, steps: int, prompt: int, compile_: bool, repeats: int) -> float:
    step = torch.compile(model, fullgraph=True) if compile_ else model
    tokens = torch.randint(0, model.shape.vocab, (1, prompt), generator=torch.Generator().manual_seed(1))

    def run() -> float:
        model(tokens, torch.arange(prompt))  # prefill (eager: its shape would need another compile)
        tok = tokens[:, -1:]
        start = time.perf_counter()
        for i in range(steps):
            tok = step(tok, torch.tensor([prompt + i])).argmax(-1, keepdim=True)
        return time.perf_counter() - start
    with torch.no_grad():
        run()  # warm-up (and compilation)
        return steps / statistics.median(run() for _ in range(repeats))


def run_decoder(args, rec) -> None:
    shape = synthetic_decoder.QUICK if args.quick else synthetic_decoder.Shape()
    base = synthetic_decoder.build(shape)
    modes = [False] if (args.quick or args.no_compile) else [False, True]
    steps, repeats = args.steps, args.repeats
    params = sum(p.numel() for p in base.parameters())
    where = {"model": f"random LLaMA-shaped decoder, {params / 1e6:.0f}M params", "dim": shape.dim,
             "layers": shape.layers, "prompt": args.prompt, "steps": steps}
    for name in args.speed_configs:
        config = build(name)
        model = copy.deepcopy(base).to(BASELINES.get(name, torch.float32))
        if config is not None:
            qk.quantize_(model, config)
        mb = sum(tensor_bytes(p) for p in model.parameters()) / 1e6
        for compiled in modes:
            case = f"synthetic decoder, {'compiled' if compiled else 'eager'}"
            print(f"[quality] {case} {name}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            rec.add(case, name, where, "decode", decode_tokens_per_s(model, steps, args.prompt, compiled, repeats),
                    "tok/s")
            rec.add(case, name, where, "weights", mb, "MB")


def run_minilm(args, rec) -> None:
    from torchqkit import demo
    names = [n for n in args.speed_configs if n not in BASELINES]
    rows = demo.run_demo(names, repeats=1 if args.quick else 3)
    where = {"model": "all-MiniLM-L6-v2", "sentences": demo.TIMED_SENTENCES, "batch": demo.BATCH_SIZE}
    if rows:
        rec.add("MiniLM encode", "float32", where, "throughput",
                demo.TIMED_SENTENCES / min(r["fp32_seconds"] for r in rows), "sentences/s")
    for name, r in zip(names, rows):
        rec.add("MiniLM encode", name, where, "throughput", demo.TIMED_SENTENCES / r["quantized_seconds"],
                "sentences/s", linear_path=r["linear_path"])
        rec.add("MiniLM encode", name, where, "mean cosine to float32", r["mean_cos"], "")
        rec.add("MiniLM encode", name, where, "weights compression", r["compression"], "x")
