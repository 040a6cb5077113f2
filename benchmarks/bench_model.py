"""Decode tokens/s of a LLaMA-shaped decoder (random weights, KV cache, batch 1) per quantization config,
eager and torch.compile; then all-MiniLM-L6-v2 encode throughput per config (torchqkit/demo.py).

    python benchmarks/bench_model.py            # ~0.5B params: dim 1536, 16 layers, GQA 12/4 heads, ffn 4096
    python benchmarks/bench_model.py --quick    # a ~40M-param model, 8 decode steps, no compile, 1 MiniLM repeat

Each decoder row: a short prompt (prefill, not timed), then --steps decode steps of one token; tokens/s is
steps / the median wall time of --repeats decode loops (prefill excluded) after one warm-up loop. Activations are float32
for fp32 and the weight-only configs (torchqkit's kernels take float32 activations), bfloat16 for bf16.
The model code is deliberately small: RMSNorm, rotary embeddings, grouped-query attention over a static
KV cache (so compiled decode sees one shape), SwiGLU MLP, untied lm_head.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchqkit as qk


@dataclass(frozen=True)
class Shape:
    dim: int = 1536
    layers: int = 16
    heads: int = 12
    kv_heads: int = 4
    ffn: int = 4096
    vocab: int = 32000
    max_seq: int = 256


QUICK = Shape(dim=512, layers=4, heads=8, kv_heads=2, ffn=1408, vocab=8000, max_seq=128)


class Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.heads, self.kv_heads, self.hd = s.heads, s.kv_heads, s.dim // s.heads
        self.wq = nn.Linear(s.dim, s.dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(s.dim, s.dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, s.kv_heads, s.max_seq, self.hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, s.kv_heads, s.max_seq, self.hd), persistent=False)

    def forward(self, x, cos, sin, pos, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, pos, v.to(self.v_cache.dtype))
        out = F.scaled_dot_product_attention(q, self.k_cache.to(q.dtype), self.v_cache.to(q.dtype), attn_mask=mask,
                                             enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(s.dim), nn.RMSNorm(s.dim)
        self.attn = Attention(s)
        self.w1, self.w3 = nn.Linear(s.dim, s.ffn, bias=False), nn.Linear(s.dim, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x, cos, sin, pos, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, pos, mask)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.shape = s
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)
        hd = s.dim // s.heads
        freqs = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(s.max_seq).float(), freqs)  # (max_seq, hd / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("causal", torch.ones(s.max_seq, s.max_seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, tokens, pos):
        """tokens (1, T) at positions pos (T,) -> logits of the last token (1, vocab)."""
        x = self.embed(tokens)
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)
        mask = self.causal[pos]  # (T, max_seq): attends to cached positions <= its own
        for blk in self.blocks:
            x = blk(x, cos, sin, pos, mask)
        return self.lm_head(self.norm(x[:, -1]))


def build(shape: Shape) -> Decoder:
    torch.manual_seed(0)
    with torch.no_grad():
        model = Decoder(shape)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return model.eval()


def decode_tokens_per_s(model, steps: int, prompt: int, compile_: bool, repeats: int) -> float:
    """steps / median wall time of `repeats` decode loops (each after its own untimed prefill)."""
    step = torch.compile(model, fullgraph=True) if compile_ else model
    tokens = torch.randint(0, model.shape.vocab, (1, prompt), generator=torch.Generator().manual_seed(1))

    def run() -> float:
        model(tokens, torch.arange(prompt))  # prefill (eager: its shape would need another compile)
        tok = tokens[:, -1:]
        start = time.perf_counter()
        for i in range(steps):
            logits = step(tok, torch.tensor([prompt + i]))
            tok = logits.argmax(-1, keepdim=True)
        return time.perf_counter() - start
    with torch.no_grad():
        run()  # warm-up (and compilation)
        return steps / statistics.median(run() for _ in range(repeats))


CONFIGS = {  # name -> (dtype of the float model, config or None)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8-wo": (torch.float32, lambda: qk.Int8WeightOnlyConfig()),
    "int4-wo-g128": (torch.float32, lambda: qk.Int4WeightOnlyConfig(group_size=128)),
    "nf4-b64": (torch.float32, lambda: qk.NF4WeightOnlyConfig(block_size=64)),
    "fp8-wo": (torch.float32, lambda: qk.Float8WeightOnlyConfig()),
}
MINILM_CONFIGS = {"int8-wo": "int8-wo", "int4-wo-g128": "int4-wo-g128", "nf4-b64": "nf4-b64", "fp8-wo": "fp8-wo"}


def machine() -> str:
    cpu = platform.processor() or "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} logical CPUs, load average {load:.1f}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), torchqkit {qk.__version__}")


def weight_mb(model) -> float:
    total = 0
    for t in list(model.parameters()):
        inner = t.inner_tensors().values() if hasattr(t, "inner_tensors") else [t]
        total += sum(v.numel() * v.element_size() for v in inner if v is not None)
    return total / 1e6


def minilm_rows(names, repeats):
    """sentences/s of all-MiniLM-L6-v2 per config, via torchqkit/demo.py (64 sentences, batch 64)."""
    from torchqkit import demo
    rows = demo.run_demo([MINILM_CONFIGS[n] for n in names if n in MINILM_CONFIGS], repeats=repeats)
    out = {"fp32": demo.TIMED_SENTENCES / min(r["fp32_seconds"] for r in rows)} if rows else {}
    for name, r in zip([n for n in names if n in MINILM_CONFIGS], rows):
        out[name] = demo.TIMED_SENTENCES / r["quantized_seconds"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, 8 steps, eager only, 1 MiniLM repeat")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=None, help="decode steps per measurement (default 32; quick 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed decode loops per cell (median; quick 1)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (prefill before decoding)")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--no-minilm", action="store_true", help="skip the MiniLM encode throughput")
    args = p.parse_args()
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    shape = QUICK if args.quick else Shape()
    steps = args.steps or (8 if args.quick else 32)
    modes = [False] if (args.quick or args.no_compile) else [False, True]

    print(f"machine: {machine()}")
    base = build(shape)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"decoder: {n_params / 1e6:.0f}M params {shape}, batch 1, prompt {args.prompt}, {steps} decode steps, "
          f"median of {1 if args.quick else args.repeats} loops")
    results = {}
    for name in names:
        dtype, make = CONFIGS[name]
        model = copy.deepcopy(base).to(dtype)
        if make is not None:
            qk.quantize_(model, make())
        for compiled in modes:
            print(f"  {name} {'compiled' if compiled else 'eager'} ...", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            results[name, compiled] = decode_tokens_per_s(model, steps, args.prompt, compiled,
                                                          1 if args.quick else args.repeats)
        results[name, "mb"] = weight_mb(model)
        del model
    minilm = {} if args.no_minilm else minilm_rows(names, 1 if args.quick else 3)

    head = f"{'config':<14} {'weights MB':>10} {'eager tok/s':>12}"
    head += f" {'compiled tok/s':>15}" if True in modes else ""
    head += f" {'MiniLM sent/s':>14}" if minilm else ""
    print(head)
    for name in names:
        line = f"{name:<14} {results[name, 'mb']:10.0f} {results[name, False]:12.2f}"
        if True in modes:
            line += f" {results[name, True]:15.2f}"
        if minilm:
            line += f" {minilm[name]:14.1f}" if name in minilm else f" {'-':>14}"
        print(line)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
