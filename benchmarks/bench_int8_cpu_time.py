"""The int8 CPU ops timed in thread CPU time: before / after comparisons of the kernels on a shared, loaded host.

    python benchmarks/bench_int8_cpu_time.py --shapes 4096:4096 --ms 1,8,256
    TORCHQKIT_CPU_ISA=avx2 python benchmarks/bench_int8_cpu_time.py ...     # a lower ISA level of the kernels

bench_linear.py times wall-clock medians; with other jobs on the same two cores (load average 6 here) those
drift by 2-3x between runs, which hides any kernel change. This script runs one torch thread and reads
time.thread_time() around each call: the CPU time of the calling thread, which the ops run on with one
thread, so time spent descheduled doesn't count (cache sharing with neighbours still does). Each cell is
the fastest of --reps calls. Decode rows (M <= 8) cycle through copies of the weight that together exceed
the L3 cache, as bench_linear.py does, so the weight comes from memory.

Columns: f32 = F.linear with the float weight; wo f32 / wo bf16 = torchqkit::linear_int8wo_plain with f32 /
bf16 activations; da8 = torchqkit::linear_int8da_int8_plain (per-token symmetric int8 activations); xf32 =
f32 time / the column's time.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import torchqkit  # noqa: F401  (registers the torchqkit ops)
from torchqkit import kernels
from bench_linear import RING_BYTES  # a sibling file: benchmarks/ is sys.path[0] as a script


def cpu_time(fn, ring, reps: int) -> float:
    """The fastest thread CPU time (s) of fn(*ring[i % len(ring)]) over reps calls, after one warm-up."""
    fn(*ring[0])
    best = float("inf")
    for i in range(reps):
        t0 = time.thread_time()
        fn(*ring[i % len(ring)])
        best = min(best, time.thread_time() - t0)
    return best


def cells(k: int, n: int, m: int, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=g)
    xb = x.bfloat16()
    copies = max(1, RING_BYTES // (n * k)) if m <= 8 else 1
    ring = [(q.clone(), scale.clone(), q.float()) for _ in range(copies)]
    wo, da = torch.ops.torchqkit.linear_int8wo_plain, torch.ops.torchqkit.linear_int8da_int8_plain
    return {
        "f32": cpu_time(lambda q, s, wf: F.linear(x, wf), ring, reps),
        "wo f32": cpu_time(lambda q, s, wf: wo(x, q, s, None), ring, reps),
        "wo bf16": cpu_time(lambda q, s, wf: wo(xb, q, s.bfloat16(), None), ring, reps),
        "da8": cpu_time(lambda q, s, wf: da(x, q, s, None, True), ring, reps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096:4096", help="K:N pairs, e.g. 4096:4096,4096:11008")
    ap.add_argument("--ms", default="1,8,256", help="batch sizes")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per cell (the fastest counts)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    op = "torchqkit::linear_int8da_int8_plain"
    print(f"torch {torch.__version__}, 1 thread, thread CPU time (fastest of {args.reps}); "
          f"{op}: {' '.join(kernels.cpu_backend(op))}")
    cols = ["f32", "wo f32", "wo bf16", "da8"]
    print(f"{'K':>6}{'N':>6}{'M':>5}" + "".join(f"{c:>10}" for c in cols) + f"{'da8 xf32':>10}{'wo xf32':>9}    [ms]")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split(":"))
        for m in (int(v) for v in args.ms.split(",")):
            t = cells(k, n, m, args.reps)
            print(f"{k:>6}{n:>6}{m:>5}" + "".join(f"{t[c] * 1e3:>10.2f}" for c in cols)
                  + f"{t['f32'] / t['da8']:>9.1f}x{t['f32'] / t['wo f32']:>8.1f}x")


if __name__ == "__main__":
    main()
