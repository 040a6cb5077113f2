"""Quantization-aware training recovers quality: all-MiniLM-L6-v2, int4 weights (g32 / g64).

    python benchmarks/bench_qat.py                       # int4 g32 and g64, 300 steps each
    python benchmarks/bench_qat.py --group-sizes 64 --steps 100

Objective (sentence similarity, self-distillation): the float model's sentence embeddings are the target;
the student trains so its embeddings keep cosine 1 with them. Sentences: torchqkit's own text (Persuasion,
ch. 1-8) cut into sentences; the first 80% train, the last 20% are held out. For each group size:
  RTN  post-training round-to-nearest (quantize_ on the float model)
  QAT  prepare_qat_ -> AdamW for --steps steps (batch --batch) -> convert_qat_
and the held-out quality of each: mean(1 - cosine) to the float embeddings (the "cosine delta"), and the
worst sentence's cosine. The QAT model is measured after convert_qat_ (real int4 weights, the AUTO kernels).
Also printed: the training loss curve (mean 1 - cosine on the training batches).
"""
from __future__ import annotations

import argparse
import copy
import platform
import re
import time

import torch

import torchqkit as qk
from torchqkit.demo import load_model
from torchqkit.eval.models import eval_text


def sentences() -> tuple[list[str], list[str]]:
    parts = re.split(r"(?<=[.!?])\s+", " ".join(eval_text().split()))
    kept = [s for s in parts if 6 <= len(s.split()) <= 60]
    cut = int(len(kept) * 0.8)
    return kept[:cut], kept[cut:]


def embed(model, batch: list[str]) -> torch.Tensor:
    """Differentiable sentence embeddings (SentenceTransformer's forward: mean pooling + normalisation)."""
    features = model.tokenize(batch)
    return model(features)["sentence_embedding"]


@torch.no_grad()
def embed_all(model, texts: list[str], batch: int = 64) -> torch.Tensor:
    model.eval()
    return torch.cat([embed(model, texts[i:i + batch]) for i in range(0, len(texts), batch)])


def quality(model, texts, target) -> tuple[float, float]:
    cos = torch.nn.functional.cosine_similarity(embed_all(model, texts), target, dim=-1)
    return float((1 - cos).mean()), float(cos.min())


def train_qat(model, train, target, steps: int, batch: int, lr: float, seed: int, log_every: int):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    curve, window = [], []
    model.eval()  # no dropout: the student should match the teacher's (eval-mode) embeddings exactly
    for step in range(1, steps + 1):
        idx = torch.randint(len(train), (batch,), generator=gen).tolist()
        emb = embed(model, [train[i] for i in idx])
        loss = (1 - torch.nn.functional.cosine_similarity(emb, target[idx], dim=-1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        window.append(loss.item())
        if step % log_every == 0 or step == 1:
            curve.append((step, sum(window) / len(window)))
            window = []
    return curve


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-sizes", type=int, nargs="+", default=[32, 64])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--grad", choices=["ste", "clipped_ste"], default="ste")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-vCPU host, 2 threads wait on each other)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train, held = sentences()
    teacher = load_model()
    train_target, held_target = embed_all(teacher, train), embed_all(teacher, held)
    print(f"all-MiniLM-L6-v2, {len(train)} training / {len(held)} held-out sentences; {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    rows = []
    for g in args.group_sizes:
        config = qk.Int4WeightOnlyConfig(group_size=g)
        rtn = copy.deepcopy(teacher)
        qk.quantize_(rtn, config)
        rtn_delta, rtn_worst = quality(rtn, held, held_target)

        student = copy.deepcopy(teacher)
        qk.prepare_qat_(student, qk.QATConfig(config, grad=args.grad))
        start = time.perf_counter()
        curve = train_qat(student, train, train_target, args.steps, args.batch, args.lr, args.seed,
                          max(1, args.steps // 12))
        seconds = time.perf_counter() - start
        fake_delta, _ = quality(student, held, held_target)
        qk.convert_qat_(student)
        qat_delta, qat_worst = quality(student, held, held_target)
        print(f"\nint4 g{g} QAT training loss (mean 1 - cos over the batches since the previous row):")
        print("  " + "  ".join(f"{s}:{l:.5f}" for s, l in curve))
        print(f"  held-out 1 - cos with fake quantization {fake_delta:.6f}, after convert_qat_ {qat_delta:.6f}; "
              f"{args.steps} steps in {seconds:.0f} s")
        rows.append((f"int4 g{g}", rtn_delta, rtn_worst, qat_delta, qat_worst, qat_delta / rtn_delta))

    print(f"\nheld-out cosine delta to the float model (mean 1 - cos), {args.steps} QAT steps, batch {args.batch}, "
          f"lr {args.lr:g}, grad={args.grad}")
    print(f"| config | RTN 1-cos | RTN worst cos | QAT 1-cos | QAT worst cos | QAT / RTN |")
    print(f"|---|---|---|---|---|---|")
    for name, rd, rw, qd, qw, ratio in rows:
        print(f"| {name} | {rd:.6f} | {rw:.5f} | {qd:.6f} | {qw:.5f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
