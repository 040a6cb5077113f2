"""train group, float8 part: a small LLaMA-shaped model trained from scratch in float32 and with float8 training
(enable_float8_training_: e4m3 forward, e5m2 or e4m3 gradients, float32 master weights), its loss curve and held-out
loss against float32's, same batches, same seed.

The model: byte-level (vocab 256) decoder with RMSNorm, rotary attention with grouped KV heads and a SwiGLU MLP (dim
128, 4 layers, 4 heads / 2 KV heads, MLP 352, untied head); the data: torchqkit's own text as bytes, the first 90% for
training, the last 10% held out (batch 4 x 128 bytes, AdamW lr 2e-3, cosine decay). On CPU the float8 matmuls are
emulated (float8_training_status() says so); the casts are exact. The recipes are float8 training recipes, not
inference configs, so each is a record's case (enable_float8_training_'s recipe, granularity and gradient format) and
every record's config is float32, the master weights every run keeps. The static recipe takes its scales from
CALIBRATION_STEPS batches drawn with another seed (float8_training_calibration, margin 2) and records what saturated
over the run (float8_training_overflows)."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchqkit as qk
from torchqkit.eval.models import eval_text

from .synthetic_decoder import rotate

DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, SEQ = 128, 4, 4, 2, 352, 256, 128
# name -> (recipe, granularity, gradient format), or None: float32
RECIPES = {"float32": None, "fp8-dynamic-tensor": ("dynamic", "tensor", "float8_e5m2"),
           "fp8-dynamic-row": ("dynamic", "row", "float8_e5m2"),
           "fp8-delayed-tensor": ("delayed", "tensor", "float8_e5m2"),
           "fp8-dynamic-tensor-e4m3-grads": ("dynamic", "tensor", "float8_e4m3fn"),
           "fp8-static-tensor": ("static", "tensor", "float8_e5m2"),
           "fp8-static-tensor-e4m3-grads": ("static", "tensor", "float8_e4m3fn")}
CALIBRATION_STEPS, CALIBRATION_MARGIN = 4, 2.0


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


class ByteLlama(nn.Module):
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


def batches(train, steps, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(train.numel() - SEQ - 1, (batch,), generator=gen)
        chunk = torch.stack([train[s:s + SEQ + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def held_out_loss(model, held, limit: int | None = None) -> float:
    n = (held.numel() - 1) // SEQ if limit is None else limit
    x, y = held[:n * SEQ].view(n, SEQ), held[1:n * SEQ + 1].view(n, SEQ)
    return float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def calibrate(model, train_bytes, batch, seed) -> None:
    """The static recipe's scales from CALIBRATION_STEPS forward + backward passes on batches of another seed."""
    with qk.float8_training_calibration(model, margin=CALIBRATION_MARGIN):
        for x, y in batches(train_bytes, CALIBRATION_STEPS, batch, seed + 1000):
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    model.zero_grad(set_to_none=True)


def saturation(model) -> dict:
    """Static recipe: saturating casts summed over the layers, and the largest peak, per tensor."""
    report = qk.float8_training_overflows(model)
    return {t: {"casts": sum(r[t]["casts"] for r in report.values()),
                "peak": max(r[t]["peak"] for r in report.values())} for t in ("input", "weight", "grad_output")}


def train(name, steps, batch, lr, seed, log_every, held_limit):
    torch.manual_seed(seed)
    model = ByteLlama()
    train_bytes, held = data()
    if RECIPES[name] is not None:
        recipe, granularity, grad_dtype = RECIPES[name]
        report = qk.enable_float8_training_(model, recipe, granularity=granularity, grad_dtype=grad_dtype)
        assert not report.skipped, str(report)
        if recipe == "static":
            calibrate(model, train_bytes, batch, seed)
    start = time.perf_counter()
    curve = fit(model, steps, batch, lr, seed, log_every)
    static = RECIPES[name] is not None and RECIPES[name][0] == "static"
    return curve, held_out_loss(model, held, held_limit), time.perf_counter() - start, (saturation(model) if static
                                                                                         else None)


def fit(model, steps, batch, lr, seed, log_every=None) -> list[float]:
    """`steps` AdamW steps (weight decay 0.1, 20 warm-up steps, cosine decay, gradients clipped at 1) on the training
    bytes; the mean training loss of every `log_every` steps (none without it)."""
    train_bytes, _ = data()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    curve, window = [], []
    for step, (x, y) in enumerate(batches(train_bytes, steps, batch, seed), 1):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        window.append(loss.item())
        if log_every and step % log_every == 0:
            curve.append(sum(window) / len(window))
            window = []
    return curve


def run(args, rec) -> None:
    log_every = max(1, args.steps // 10)
    status = qk.float8_training_status()
    shape = {"model": f"byte-level LLaMA dim {DIM}, {LAYERS} layers", "steps": args.steps, "batch": args.batch,
             "lr": args.lr}
    results = {name: train(name, args.steps, args.batch, args.lr, args.seed, log_every, 4 if args.quick else None)
               for name in args.recipes}
    base = results.get("float32")
    for name, (curve, held, seconds, saturated) in results.items():
        extra = dict(loss_curve=curve, log_every=log_every, float8_path=f"{status['path']} ({status['why']})")
        if saturated is not None:
            extra["saturation"] = saturated
        case = f"training: {name}"
        rec.add(case, "float32", shape, "held-out loss", held, "", **extra)
        rec.add(case, "float32", shape, "training", seconds, "s")
        if base is not None and name != "float32":
            rec.add(case, "float32", shape, "held-out loss vs float32", 100 * (held - base[1]) / base[1], "%")
            worst = max(abs(a - b) / b for a, b in zip(curve, base[0]))
            rec.add(case, "float32", shape, "largest training-loss gap to float32", 100 * worst, "%")
