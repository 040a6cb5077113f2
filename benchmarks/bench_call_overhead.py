"""What one quantized-linear call costs besides its kernel: the dispatch around a 64 x 64 weight at M = 1.

    python benchmarks/bench_call_overhead.py

Times are CPU time of the calling thread (time.thread_time), one torch thread, median of 7 x 3000 calls: on a
shared host the wall clock drifts far more than the work a call does. Columns, per config:
  F.linear no_grad / inference_mode: the quantized linear as a model calls it (it calls the op below the
      autograd keys when nothing needs a gradient, Note [Op calls without autograd]: the two should agree);
  op no_grad / inference_mode: the torchqkit custom op called directly, as inductor's wrapper calls it in a
      compiled graph; under no_grad each call enters the op's Python autograd kernel, under inference_mode it
      does not (why LeanDecoder decodes under inference_mode).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchqkit as qk
from torchqkit.layouts.routes import route_for

CONFIGS = {"int4 g32": lambda: qk.Int4WeightOnlyConfig(group_size=32), "int8": qk.Int8WeightOnlyConfig,
           "nf4": qk.NF4WeightOnlyConfig, "int8-dyn": qk.Int8DynamicActivationInt8WeightConfig}


def median_us(fn, calls: int = 3000, repeats: int = 7) -> float:
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(1, 64)
    print("64 x 64 quantized linear, M = 1, us of CPU per call (1 thread, median of 7 x 3000 calls)")
    print(f"{'config':9s}  {'F.linear no_grad':>16s}  {'inference_mode':>14s}  {'op no_grad':>10s}  "
          f"{'inference_mode':>14s}")
    for name, make in CONFIGS.items():
        layer = nn.Sequential(nn.Linear(64, 64))
        qk.quantize_(layer, make())
        w = layer[0].weight
        route = route_for(w, x)
        op = route.dispatched_op
        cells = []
        for fn in (lambda: F.linear(x, w), lambda: route.call(op, w, x, None)):
            for mode in (torch.no_grad, torch.inference_mode):
                with mode():
                    cells.append(median_us(fn))
        print(f"{name:9s}  " + "  ".join(f"{c:>{width}.1f}" for c, width in zip(cells, (16, 14, 10, 14))))


if __name__ == "__main__":
    main()
