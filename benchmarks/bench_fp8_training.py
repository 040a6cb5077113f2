"""float8 training of a small LLaMA-shaped model from scratch: loss curves against float32 training.

    python benchmarks/bench_fp8_training.py                    # 300 steps: fp32, fp8 dynamic tensor / row, delayed
    python benchmarks/bench_fp8_training.py --steps 100 --runs fp32 fp8-dynamic-tensor

The model: byte-level (vocab 256) decoder with RMSNorm, rotary attention with grouped KV heads and a SwiGLU MLP
(dim 128, 4 layers, 4 heads / 2 KV heads, MLP 352, untied head), initialised from one seed; the data: torchqkit's
own text (Persuasion ch. 1-8) as bytes, the first 90% for training, the last 10% held out. Every run sees the same
batches (batch 4 x 128 bytes, AdamW lr 2e-3, cosine decay). fp8 runs call enable_float8_training_ on every
Linear: e4m3 forward, e5m2 gradients, float32 master weights; on CPU the float8 matmuls are emulated
(float8_training_status() says so), the casts are exact.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchqkit as qk
from torchqkit.eval.models import eval_text

DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, SEQ = 128, 4, 4, 2, 352, 256, 128
RUNS = {"fp32": None, "fp8-dynamic-tensor": ("dynamic", "tensor"), "fp8-dynamic-row": ("dynamic", "row"),
        "fp8-delayed-tensor": ("delayed", "tensor")}


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = DIM // HEADS
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = rotate(self.q_proj(h).view(b, t, HEADS, self.hd).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(h).view(b, t, KV_HEADS, self.hd).transpose(1, 2), cos, sin)
        v = self.v_proj(h).view(b, t, KV_HEADS, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, DIM))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        hd = DIM // HEADS
        angles = torch.outer(torch.arange(SEQ).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.tensor(list(" ".join(eval_text().split()).encode("utf-8")), dtype=torch.long)
    cut = int(raw.numel() * 0.9)
    return raw[:cut], raw[cut:]


def batches(train: torch.Tensor, steps: int, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(train.numel() - SEQ - 1, (batch,), generator=gen)
        chunk = torch.stack([train[s:s + SEQ + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def held_out_loss(model, held: torch.Tensor) -> float:
    n = (held.numel() - 1) // SEQ
    x = held[:n * SEQ].view(n, SEQ)
    y = held[1:n * SEQ + 1].view(n, SEQ)
    return float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def run(name: str, steps: int, batch: int, lr: float, seed: int, log_every: int):
    torch.manual_seed(seed)
    model = TinyLlama()
    if RUNS[name] is not None:
        recipe, granularity = RUNS[name]
        report = qk.enable_float8_training_(model, recipe, granularity=granularity)
        assert not report.skipped, str(report)
    train, held = data()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    curve, window = [], []
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches(train, steps, batch, seed), 1):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        window.append(loss.item())
        if step % log_every == 0:
            curve.append(sum(window) / len(window))
            window = []
    return curve, held_out_loss(model, held), time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-vCPU host, 2 threads wait on each other)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    log_every = max(1, args.steps // 10)
    status = qk.float8_training_status()
    print(f"TinyLlama dim {DIM}, {LAYERS} layers, {HEADS}/{KV_HEADS} heads, MLP {FFN}, vocab {VOCAB}, seq {SEQ}; "
          f"{args.steps} steps, batch {args.batch}; {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"float8 matmul on {status['device']}: {status['path']} ({status['why']})")
    results = {name: run(name, args.steps, args.batch, args.lr, args.seed, log_every) for name in args.runs}
    base = results.get("fp32")
    steps_header = " | ".join(str(log_every * (i + 1)) for i in range(len(next(iter(results.values()))[0])))
    print(f"\ntraining loss (mean over each {log_every} steps), held-out loss at the end")
    print(f"| run | {steps_header} | held-out | vs fp32 | time |")
    print("|---|" + "---|" * (len(next(iter(results.values()))[0]) + 3))
    for name, (curve, held, seconds) in results.items():
        rel = "" if base is None else f"{100 * (held - base[1]) / base[1]:+.2f}%"
        print(f"| {name} | " + " | ".join(f"{l:.3f}" for l in curve) + f" | {held:.4f} | {rel} | {seconds:.0f} s |")
    if base is not None:
        for name, (curve, held, _) in results.items():
            if name != "fp32":
                worst = max(abs(a - b) / b for a, b in zip(curve, base[0]))
                print(f"{name}: largest gap to fp32 over the logged training losses {100 * worst:.2f}%")


if __name__ == "__main__":
    main()
