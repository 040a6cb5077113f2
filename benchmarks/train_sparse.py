"""train group, sparse part: 2:4 sparse training (prepare_sparse_, and with int4 QAT on top) against dense training
and one-shot pruning of the dense model, on the float8 part's small LLaMA-shaped byte model (train_fp8.py: same
model, data, batches, seed and schedule).

Rows, each ending with the stored model's held-out loss (after convert_sparse_ / quantize_, real sparse weights):
  dense                                  AdamW for --steps steps, float32
  dense, then 2:4 magnitude              the trained dense model pruned once (quantize_ with SparsityConfig((2, 4)))
  dense, then 2:4 magnitude + int4 g32   the same with an int4 g32 base (RTN on the kept values)
  2:4 sparse training                    prepare_sparse_(start_step = 20% of the steps, masks every 5%), then
                                         convert_sparse_
  2:4 sparse + int4 g32 QAT              prepare_sparse_ with the int4 g32 base, then prepare_qat_ with it, then
                                         convert_sparse_ (Note [Sparse quantization-aware training])
Every Linear is pruned (the head is untied). The target: sparse training within a few percent of dense."""
from __future__ import annotations

import copy
import time

import torch

import torchqkit as qk

from .train_fp8 import DIM, LAYERS, ByteLlama, data, fit, held_out_loss

INT4 = qk.Int4WeightOnlyConfig(group_size=32)
ROWS = ("dense", "dense, then 2:4 magnitude", "dense, then 2:4 magnitude + int4 g32", "2:4 sparse training",
        "2:4 sparse + int4 g32 QAT")


def _sparse_trained(steps, batch, lr, seed, base):
    torch.manual_seed(seed)
    model = ByteLlama()
    qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4), base=base), start_step=steps // 5,
                       update_every=max(1, steps // 20))
    if base is not None:
        qk.prepare_qat_(model, qk.QATConfig(base))
    fit(model, steps, batch, lr, seed)
    qk.convert_sparse_(model)
    return model


def run(args, rec) -> None:
    _, held = data()
    limit = 4 if args.quick else None
    shape = {"model": f"byte-level LLaMA dim {DIM}, {LAYERS} layers", "steps": args.steps, "batch": args.batch,
             "lr": args.lr}
    results = {}
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    dense = ByteLlama()
    fit(dense, args.steps, args.batch, args.lr, args.seed)
    results["dense"] = (held_out_loss(dense, held, limit), time.perf_counter() - start)
    for name, base in (("dense, then 2:4 magnitude", None), ("dense, then 2:4 magnitude + int4 g32", INT4)):
        start = time.perf_counter()
        pruned = copy.deepcopy(dense)
        qk.quantize_(pruned, qk.SparsityConfig(pattern=(2, 4), base=base))
        results[name] = (held_out_loss(pruned, held, limit), time.perf_counter() - start)
    for name, base in (("2:4 sparse training", None), ("2:4 sparse + int4 g32 QAT", INT4)):
        start = time.perf_counter()
        model = _sparse_trained(args.steps, args.batch, args.lr, args.seed, base)
        results[name] = (held_out_loss(model, held, limit), time.perf_counter() - start)
    dense_loss = results["dense"][0]
    for name in ROWS:
        loss, seconds = results[name]
        case = f"sparse training: {name}"
        rec.add(case, "float32", shape, "held-out loss", loss, "")
        rec.add(case, "float32", shape, "held-out loss vs dense", 100 * (loss - dense_loss) / dense_loss, "%")
        rec.add(case, "float32", shape, "training", seconds, "s")
