"""torchqkit::linear_int4wo_tiled at M = 1 on SmolLM2-135M's matrices: time per call and weight GB/s, per tiling.

    python benchmarks/bench_int4_tiled_decode.py                 # g128, inner_k_tiles 8, fp32 x, hot, 1 thread
    python benchmarks/bench_int4_tiled_decode.py --group 32 --dtype bf16 --m 1
    python benchmarks/bench_int4_tiled_decode.py --group 32 --scale-dtype f32   # a float32 model's scales
    python benchmarks/bench_int4_tiled_decode.py --group 32 --tiles 8,4 --ring --threads 2   # decode as it runs
    TORCHQKIT_CPU_ISA=avx2 python benchmarks/bench_int4_tiled_decode.py   # any level the CPU runs

The op is called directly under inference_mode. By default on one torch thread with its weight reused (hot: the
kernel's compute, apart from the memory bus); each figure is the fastest of 5 repeats of the CPU time of the calling
thread (time.thread_time) over a batch of calls: a shared host's wall clock measures its neighbours. With --ring
each call reads the next copy of the weight from a ring of copies > 3x L3 (bench_linear.RING_BYTES) (from memory, as a decode step reads
it), timed by the wall clock (the other threads' work counts): the median call of 3 rounds that alternate the
tilings' order, each round's median of 300 calls. The K x 8 row is almost all fixed cost: Python and the
dispatcher (not the op's), plus the op's checks, allocation and activation permutation; "GB/s" counts the weight's
stored bytes (codes + scale/zero, the padding included) per call over the call's whole time. K = 576 is SmolLM2's
hidden size (padded to 640 at inner_k_tiles 8, to 576 at 4: Note [inner_k_tiles per weight]); lm_head is 49152 x
576. "per token" weighs each row by its calls in one SmolLM2 decode step (30 layers; the 8-row probe and 4096^2
count 0).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchqkit as qk
from bench_linear import RING_BYTES  # a sibling file: benchmarks/ is sys.path[0] as a script

# (K, N, calls per SmolLM2 decode step); 960 and 3072 are its q/k/v and gate/up fused (Note [Fused projections]),
# counted in FUSED below, not in the per-token sum
SHAPES = [(576, 8, 0), (576, 192, 60), (576, 576, 60), (576, 1536, 60), (1536, 576, 30), (576, 49152, 1),
          (4096, 4096, 0), (576, 960, 0), (576, 3072, 0)]
FUSED = {"q/k/v": ([576, 192, 192], 960), "gate/up": ([1536, 1536], 3072)}  # separate rows -> fused rows, K = 576
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


def ring_seconds(op_call, copies: list, calls: int = 300) -> float:
    """The median wall time of `calls` calls, each on the next copy (one round: the caller alternates tilings)."""
    times, i = [], 0
    for _ in range(calls + 20):
        t0 = time.perf_counter()
        op_call(copies[i % len(copies)])
        times.append(time.perf_counter() - t0)
        i += 1
    return statistics.median(times[20:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=128, help="group size (32, 64, 128, 256)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="activation dtype")
    p.add_argument("--m", type=int, default=1, help="tokens per call")
    p.add_argument("--scale-dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the weight, hence of its scales and zeros (f32: a float32 model's, as SmolLM2 here)")
    p.add_argument("--tiles", default="8", help="comma-separated inner_k_tiles to compare (of 2, 4, 8)")
    p.add_argument("--ring", action="store_true", help="weights from memory (a ring of copies), wall clock")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    tiles = [int(t) for t in args.tiles.split(",")]
    torch.set_num_threads(args.threads)
    op = torch.ops.torchqkit.linear_int4wo_tiled
    mode = "from memory (ring), wall clock" if args.ring else "hot weight, CPU time"
    print(f"torchqkit::linear_int4wo_tiled, g{args.group}, {args.dtype} x, {args.scale_dtype} scales, M = {args.m}, "
          f"{args.threads} thread(s), {mode} (kernel: {qk.kernels.cpu_backend('torchqkit::linear_int4wo_tiled')[0]})")
    print(f"{'K':>5} {'N':>6}" + "".join(f" {'T' + str(t) + ' us':>9} {'GB/s':>6}" for t in tiles)
          + (f" {'T' + str(tiles[0]) + '/T' + str(tiles[-1]):>9}" if len(tiles) > 1 else ""))
    per_token = dict.fromkeys(tiles, 0.0)
    at576 = {}  # N -> {tiling: seconds} at K = 576
    for k, n, calls in SHAPES:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g).to(DTYPES[args.scale_dtype])
        x = torch.randn(args.m, k, generator=g).to(DTYPES[args.dtype])
        weights = {}
        for t in tiles:
            copies = max(1, min(400, RING_BYTES // (n * k // 2) + 1)) if args.ring else 1
            weights[t] = [qk.quantize_weight(w + 1e-3 * c, qk.qdtypes.uint4, qk.PerGroup(args.group),
                                             qk.TensorCoreTiledLayout(inner_k_tiles=t), mapping="asymmetric",
                                             zero_point_domain="float") for c in range(copies)]
        nbytes = {t: ws[0].qdata.numel() * 4 + ws[0].scale_and_zero.numel() * ws[0].scale_and_zero.element_size()
                  for t, ws in weights.items()}
        secs = {t: [] for t in tiles}
        with torch.inference_mode():
            for r in range(3 if args.ring else 1):
                for t in (tiles if r % 2 == 0 else tiles[::-1]):
                    call = lambda a: op(x, a.qdata, a.scale_and_zero, args.group, n, None)  # noqa: E731
                    if args.ring:
                        secs[t].append(ring_seconds(call, weights[t]))
                    else:
                        a = weights[t][0]
                        secs[t].append(call_seconds(lambda: call(a), nbytes[t]))
        row = f"{k:>5} {n:>6}"
        for t in tiles:
            sec = statistics.median(secs[t])
            per_token[t] += calls * sec
            if k == 576:
                at576.setdefault(n, {})[t] = sec
            row += f" {sec * 1e6:9.1f} {nbytes[t] / sec / 1e9:6.1f}"
        if len(tiles) > 1:
            row += f" {statistics.median(secs[tiles[0]]) / statistics.median(secs[tiles[-1]]):8.2f}x"
        print(row, flush=True)
    print("per token (SmolLM2 decode step's calls): " + ", ".join(f"T{t} {ms * 1e3:.2f} ms" for t, ms in per_token.items()))
    for what, (rows, fused) in FUSED.items():  # one layer's group: separate calls against one fused call
        print(f"{what} of one layer, T{tiles[-1]}: {len(rows)} calls "
              f"{sum(at576[n][tiles[-1]] for n in rows) * 1e6:.1f} us, fused {at576[fused][tiles[-1]] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
