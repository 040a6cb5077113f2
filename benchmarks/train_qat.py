"""train group, QAT part: quantization-aware training recovers quality on all-MiniLM-L6-v2, int4 weights.

Objective (sentence similarity, self-distillation): the float model's sentence embeddings are the target; the student
trains so its embeddings keep cosine 1 with them. Sentences: torchqkit's own text cut into sentences; the first 80%
train, the last 20% are held out. Per config: RTN (quantize_ on the float model) and QAT (prepare_qat_ -> AdamW for
--steps steps -> convert_qat_), and the held-out quality of each: mean(1 - cosine) to the float embeddings and the
worst sentence's cosine; QAT measured after convert_qat_ (real int4 weights); also the training loss curve."""
from __future__ import annotations

import copy
import re
import time

import torch

import torchqkit as qk
from torchqkit.eval.models import eval_text

from .common.configs import build


def sentences() -> tuple[list[str], list[str]]:
    parts = re.split(r"(?<=[.!?])\s+", " ".join(eval_text().split()))
    kept = [s for s in parts if 6 <= len(s.split()) <= 60]
    cut = int(len(kept) * 0.8)
    return kept[:cut], kept[cut:]


def embed(model, batch: list[str]) -> torch.Tensor:
    """Differentiable sentence embeddings (SentenceTransformer's forward: mean pooling + normalisation)."""
    return model(model.tokenize(batch))["sentence_embedding"]


@torch.no_grad()
def embed_all(model, texts: list[str], batch: int = 64) -> torch.Tensor:
    model.eval()
    return torch.cat([embed(model, texts[i:i + batch]) for i in range(0, len(texts), batch)])


def quality(model, texts, target) -> tuple[float, float]:
    cos = torch.nn.functional.cosine_similarity(embed_all(model, texts), target, dim=-1)
    return float((1 - cos).mean()), float(cos.min())


def train_qat(model, train, target, steps, batch, lr, seed, log_every):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    curve, window = [], []
    model.eval()  # no dropout: the student should match the teacher's (eval-mode) embeddings exactly
    for step in range(1, steps + 1):
        idx = torch.randint(len(train), (batch,), generator=gen).tolist()
        loss = (1 - torch.nn.functional.cosine_similarity(embed(model, [train[i] for i in idx]), target[idx],
                                                           dim=-1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        window.append(loss.item())
        if step % log_every == 0 or step == 1:
            curve.append((step, sum(window) / len(window)))
            window = []
    return curve


def run(args, rec) -> None:
    from torchqkit.demo import load_model
    train, held = sentences()
    if args.quick:
        train, held = train[:32], held[:16]
    teacher = load_model()
    train_target, held_target = embed_all(teacher, train), embed_all(teacher, held)
    shape = {"model": "all-MiniLM-L6-v2", "train_sentences": len(train), "held_out": len(held), "steps": args.steps,
             "batch": args.batch, "lr": args.lr, "grad": args.grad}
    for name in args.qat_configs:
        config = build(name)
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
        rec.add("RTN", name, shape, "held-out 1 - cos (mean)", rtn_delta, "")
        rec.add("RTN", name, shape, "held-out worst cos", rtn_worst, "")
        rec.add("QAT", name, shape, "held-out 1 - cos (mean)", qat_delta, "", fake_quantized=fake_delta,
                loss_curve=curve)
        rec.add("QAT", name, shape, "held-out worst cos", qat_worst, "")
        rec.add("QAT", name, shape, "1 - cos vs RTN", qat_delta / rtn_delta if rtn_delta else None, "x")
        rec.add("QAT", name, shape, "training", seconds, "s")
