"""bf16 activations at decode M: the low-bit ops' bf16 dot kernels next to the fp32 ones, per format and M.

    python benchmarks/bench_bf16_decode.py --threads 1 --cpu-time     # CPU ms per call of this thread
    python benchmarks/bench_bf16_decode.py --threads 2                # wall ms: fastest / 25th-percentile call

For each format of bench_lowbit.py at 4096 x 4096 and M in --ms, two columns: "bf16 x" = the op on bfloat16
activations as routed (the rule in csrc/cpu/linear_lowbit_ops.cpp, bf16_dot_wins, picks the bf16 dot kernel or
the fp32 one per format and M), "f32 kernel" = the op on the same activations converted to float32 first (the
conversion is inside the timed call), so the fp32 dot kernel runs. "bf16/f32" < 1: the bf16 route is faster.
With TORCHQKIT_CPU_ISA=avx512_vnni both columns run the fp32 kernels (a check of the harness). Every call reads its
weight from the next copy of a ring > 3x L3 (bench_linear.RING_BYTES), as a decoder's layers do.
"""
from __future__ import annotations

import argparse
import copy

import torch

from bench_linear import RING_BYTES  # a sibling file
from bench_lowbit import FORMATS, call, cpu_seconds, stored_bytes, wall_seconds  # a sibling file: benchmarks/ is sys.path[0] as a script


def timed(fns, reps: int, cpu_time: bool) -> float:
    """Seconds per call: this thread's mean CPU time, or the 25th-percentile wall time of `reps` calls."""
    return cpu_seconds(fns, reps) if cpu_time else wall_seconds(fns, reps)[reps // 4]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="nf4,fp8,mxfp4,int3")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cpu-time", action="store_true", help="this thread's CPU time per call (needs --threads 1)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time counts this thread's CPU time only: run it with --threads 1")
    torch.set_num_threads(args.threads)
    from torchqkit import kernels
    how = "CPU ms per call (mean)" if args.cpu_time else "wall ms per call (25th percentile)"
    print(f"{args.threads} thread(s), 4096 x 4096, {kernels.cpu_backend('torchqkit::linear_nf4wo')[0]}, {how}")
    print(f"  {'format':6} {'M':>3} {'bf16 x':>9} {'f32 kernel':>11} {'bf16/f32':>9}")
    ms = [int(m) for m in args.ms.split(",")]
    g = torch.Generator().manual_seed(0)
    for name in args.formats.split(","):
        w = FORMATS[name][0](torch.randn(4096, 4096, generator=g) * 0.02)
        ring = [w] + [copy.deepcopy(w) for _ in range(RING_BYTES // stored_bytes(w))]
        for m in ms:
            xb = torch.randn(m, 4096, generator=g).bfloat16()
            bf16 = [lambda r=r: call(r, xb)() for r in ring]
            f32 = [lambda r=r: call(r, xb.float())() for r in ring]  # the conversion is part of that route
            for fn in bf16[:3] + f32[:3]:
                fn()
            tb, tf = timed(bf16, args.reps, args.cpu_time), timed(f32, args.reps, args.cpu_time)
            print(f"  {name:6} {m:>3} {tb * 1e3:9.3f} {tf * 1e3:11.3f} {tb / tf:9.2f}", flush=True)


if __name__ == "__main__":
    main()
