"""torchqkit::linear_int4wo_tiled at M = 1 on SmolLM2-135M's matrices: CPU time per call and weight GB/s per core.

    python benchmarks/bench_int4_tiled_decode.py                 # g128, TensorCoreTiledLayout(8), fp32 x
    python benchmarks/bench_int4_tiled_decode.py --group 32 --dtype bf16 --m 1
    python benchmarks/bench_int4_tiled_decode.py --group 32 --scale-dtype f32   # a float32 model's scales
    TORCHQKIT_CPU_ISA=avx2 python benchmarks/bench_int4_tiled_decode.py   # any level the CPU runs

The op is called directly under inference_mode on one torch thread, its weight reused (hot: the kernel's compute,
apart from the memory bus). Each figure is the fastest of 5 repeats of the CPU time of the calling thread
(time.thread_time) over a batch of calls: a shared host's wall clock measures its neighbours. The K x 8 row is
almost all fixed cost: Python and the dispatcher (not the op's), plus the op's checks, allocation and activation
permutation; "GB/s" counts the weight's stored bytes (codes + scale/zero) per call over the call's whole time.
K = 640 is SmolLM2's hidden size 576 padded to whole groups; lm_head is 49152 x 576.
"""
from __future__ import annotations

import argparse
import time

import torch

import torchqkit as qk

SHAPES = [(640, 8), (640, 192), (640, 576), (640, 1536), (1536, 576), (640, 49152), (4096, 4096)]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def call_seconds(fn, weight_bytes: int) -> float:
    """Fastest per-call CPU time of the calling thread over 5 batches of about 200 MB of weight reads each."""
    for _ in range(20):
        fn()
    calls = max(20, min(2000, int(2e8 // weight_bytes)))
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=128, help="group size (32, 64, 128, 256)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="activation dtype")
    p.add_argument("--m", type=int, default=1, help="tokens per call")
    p.add_argument("--scale-dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the weight, hence of its scales and zeros (f32: a float32 model's, as SmolLM2 here)")
    args = p.parse_args()
    torch.set_num_threads(1)
    op = torch.ops.torchqkit.linear_int4wo_tiled
    print(f"torchqkit::linear_int4wo_tiled, g{args.group}, {args.dtype} x, {args.scale_dtype} scales, M = {args.m}, 1 thread, hot weight, "
          f"CPU time (kernel: {qk.kernels.cpu_backend('torchqkit::linear_int4wo_tiled')[0]})")
    print(f"{'K':>5} {'N':>6} {'us/call':>9} {'GB/s':>6}")
    for k, n in SHAPES:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g).to(DTYPES[args.scale_dtype])
        aqt = qk.quantize_weight(w, qk.qdtypes.uint4, qk.PerGroup(args.group), qk.TensorCoreTiledLayout(inner_k_tiles=8),
                                 mapping="asymmetric", zero_point_domain="float")
        x = torch.randn(args.m, k, generator=g).to(DTYPES[args.dtype])
        q, sz = aqt.qdata, aqt.scale_and_zero
        nbytes = q.numel() * q.element_size() + sz.numel() * sz.element_size()
        with torch.inference_mode():
            t = call_seconds(lambda: op(x, q, sz, args.group, n, None), nbytes)
        print(f"{k:>5} {n:>6} {t * 1e6:9.1f} {nbytes / t / 1e9:6.1f}", flush=True)


if __name__ == "__main__":
    main()
