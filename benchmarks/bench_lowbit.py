"""The low-bit weight-only columns of bench_linear.py (``--formats``): NF4, float8 and packed intx kernels
(torchqkit::linear_nf4wo / linear_fp8wo / linear_intxwo / linear_mxwo) next to fp32 F.linear, on the layouts' own bytes.

    python benchmarks/bench_linear.py --formats nf4,nf4dq,fp8,int3            # the lowbit table only
    python benchmarks/bench_linear.py --formats int8,nf4 --quick              # the int8 table, then nf4

Each cell: median ms with float32 activations; "GB/s (bw%)" counts the weight's stored bytes (codes + scales)
per call against the read bandwidth measured by the same run; "xf32" = fp32 F.linear time / kernel time;
"bf16 (bw%)" = median ms with bfloat16 activations (and output) and its share of the read bandwidth, "bxf32" = fp32
F.linear time / that time. The "bf16" column is F.linear with bf16 weights and activations (oneDNN; vdpbf16ps on
AVX512-BF16 CPUs). TORCHQKIT_CPU_ISA=avx512_vnni runs the AVX-512 kernels without bf16 dot products, for a
side-by-side with the avx512_bf16 level.

Run on its own, this file times the decode kernels in a way a loaded host disturbs less (the shared 2-vCPU hosts
run several benchmarks at once; a descheduled OpenMP thread then makes every 2-thread call wait for the
scheduler: medians of 16-20 ms for a 1 ms kernel):

    python benchmarks/bench_lowbit.py --formats nf4,fp8,mxfp4,int3 --ms 1,8 --threads 1

one thread, each call on the next copy of the weight from a ring of copies > 3x L3 (weights from memory), and
the fastest and the 25th-percentile call of --reps: what the kernel costs when it has the core, not the median
of a host's queue. GB/s here is one core's, not comparable with the 2-thread read bandwidth. With --cpu-time it
prints the thread's mean CPU time per call instead (time.thread_time; the before / after figure on a shared host).

Before / after in one run: --compare OLD_TREE runs the --cpu-time measurement on OLD_TREE's torchqkit (a copy of
the repository with its built extension) and on this one in turn, --rounds times, alternating which goes first,
and prints the median of each cell, the speed-up, one core's GB/s and its share of the read bandwidth measured
in the same run (a core needs about half of it for two to reach 70%):

    python benchmarks/bench_lowbit.py --formats nf4,fp8,mxfp4,int3 --ms 1,8 --cpu-time --compare /tmp/old_tree
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q

NF4, FP8, INTX = torch.ops.torchqkit.linear_nf4wo, torch.ops.torchqkit.linear_fp8wo, torch.ops.torchqkit.linear_intxwo
MX = torch.ops.torchqkit.linear_mxwo


def _intx(bits):
    return lambda w: qk.quantize_weight(w, getattr(Q, f"int{bits}"), qk.PerGroup(32), qk.PackedIntxLayout())


# name -> (weight from float weight, description)
FORMATS = {
    "nf4": (lambda w: qk.quantize_weight(w, Q.nf4, qk.PerGroup(64), qk.NF4Layout(64), scale_dtype=torch.float32),
            "nf4 b64"),
    "nf4dq": (lambda w: qk.quantize_weight(w, Q.nf4, qk.PerGroup(64), qk.NF4Layout(64, True), scale_dtype=torch.float32),
              "nf4 b64 double quant"),
    "fp8": (lambda w: qk.quantize_weight(w, Q.float8_e4m3fn, qk.PerRow(), qk.Float8Layout(), scale_dtype=torch.float32),
            "float8 e4m3fn per row"),
    "e5m2": (lambda w: qk.quantize_weight(w, Q.float8_e5m2, qk.PerRow(), qk.Float8Layout(), scale_dtype=torch.float32),
             "float8 e5m2 per row"),
    **{f"int{b}": (_intx(b), f"int{b} g32 symmetric, packed") for b in (2, 3, 4, 5, 6)},
    "mxfp4": (lambda w: qk.quantize_weight(w, Q.fp4_e2m1, qk.PerGroup(32), qk.MXLayout(), scale_rounding="power_of_two"),
              "MXFP4 (e2m1, E8M0 scale per 32)"),
    "mxfp8": (lambda w: qk.quantize_weight(w, Q.float8_e4m3fn, qk.PerGroup(32), qk.MXLayout(),
                                           scale_rounding="power_of_two"), "MXFP8 (e4m3, E8M0 scale per 32)"),
}


def call(w, x):
    """The op the weight's layout routes F.linear to, on its stored tensors (no Python dispatch in the timing)."""
    if isinstance(w.qlayout, qk.NF4Layout):
        return lambda: NF4(x, w.qdata, w.scale, w.scale_codes, w.scale_block_scale, w.scale_offset,
                           w.qlayout.block_size, None)
    if isinstance(w.qlayout, qk.Float8Layout):
        return lambda: FP8(x, w.qdata, w.scale, None)
    if isinstance(w.qlayout, qk.MXLayout):
        return lambda: MX(x, w.qdata, w.scale, None)
    return lambda: INTX(x, w.qdata, w.scale, w.zero_point, w.qdtype.bits, w.qdtype.signed, w.zero_point_domain.value,
                        None)


def stored_bytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in w.inner_tensors().values() if t is not None)


def lowbit_table(shapes, ms, bw, names, bench, args):
    """Prints one table: rows (K, N, M), per format ms / GB/s (bw%) / xf32."""
    from torchqkit import kernels
    path, why = kernels.cpu_backend("torchqkit::linear_nf4wo")
    print(f"  low-bit ops: {path} ({why})")
    for name in names:
        print(f"  {name}: {FORMATS[name][1]}")
    head = ["    K     N    M", f"{'f32':>8}", f"{'bf16':>8}"]
    head += [f"{name + ' ms':>10}  {'GB/s (bw%)':>12}  {'xf32':>5}  {'bf16 (bw%)':>13}  {'bxf32':>5}" for name in names]
    print("  ".join(head) + "    [ms, median; float32 activations unless bf16]")
    for k, n in shapes:
        g = torch.Generator().manual_seed(0)
        w32 = torch.randn(n, k, generator=g) * 0.02
        weights = {name: FORMATS[name][0](w32) for name in names}
        for m in ms:
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            opts = dict(cold=m <= 8, min_reps=args.reps, budget_s=args.budget)
            t32 = bench(lambda w: F.linear(x, w), w32, **opts)
            t16 = bench(lambda w: F.linear(xb, w), w32.to(torch.bfloat16), **opts)
            cells = [f"{k:>5} {n:>5} {m:>4}", f"{t32 * 1e3:8.2f}", f"{t16 * 1e3:8.2f}"]
            for name in names:
                t = bench(lambda w: call(w, x)(), weights[name], **opts)
                tb = bench(lambda w: call(w, xb)(), weights[name], **opts)
                nbytes = stored_bytes(weights[name])
                gbs = nbytes / t / 1e9
                cells.append(f"{t * 1e3:10.2f}  {gbs:5.1f} ({gbs / bw:4.0%})  {t32 / t:4.1f}x  "
                             f"{tb * 1e3:6.2f} ({nbytes / tb / 1e9 / bw:4.0%})  {t32 / tb:4.1f}x")
            print("  ".join(cells), flush=True)


def ring_calls(name: str, ms: list[int], dtype: torch.dtype, ring_bytes: int | None):
    """(M, warmed-up calls of format `name`'s 4096 x 4096 op on each weight of a ring of copies, stored bytes) per M.
    ring_bytes: the ring's size, by default bench_linear.RING_BYTES (3x L3)."""
    if ring_bytes is None:
        from bench_linear import RING_BYTES as ring_bytes  # a sibling file: benchmarks/ is sys.path[0] as a script
    g = torch.Generator().manual_seed(0)
    w = FORMATS[name][0](torch.randn(4096, 4096, generator=g) * 0.02)
    nbytes = stored_bytes(w)
    ring = [w] + [copy.deepcopy(w) for _ in range(ring_bytes // nbytes)]
    for m in ms:
        x = torch.randn(m, 4096, generator=g).to(dtype)
        fns = [call(r, x) for r in ring]
        for fn in fns[:3]:
            fn()
        yield m, fns, nbytes


def cpu_seconds(fns, reps: int) -> float:
    """This thread's mean CPU seconds (time.thread_time) per call over `reps` calls, taking fns in turn."""
    t0 = time.thread_time()
    for i in range(reps):
        fns[i % len(fns)]()
    return (time.thread_time() - t0) / reps


def wall_seconds(fns, reps: int) -> list[float]:
    """Wall seconds of each of `reps` calls, taking fns in turn, sorted (fastest first)."""
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def ring_cpu_time(name: str, ms: list[int], reps: int, dtype: torch.dtype, ring_bytes: int | None = None):
    """(M, CPU s per call, stored bytes) per M: this thread's CPU time (time.thread_time) over `reps` calls on the
    ring, which a loaded host's queue does not inflate (a descheduled thread accrues none); --threads 1 only."""
    return [(m, cpu_seconds(fns, reps), nbytes) for m, fns, nbytes in ring_calls(name, ms, dtype, ring_bytes)]


def ring_timings(name: str, ms: list[int], reps: int, dtype: torch.dtype, ring_bytes: int | None = None):
    """(M, fastest s, 25th-percentile s, stored bytes) per M for format `name` at 4096 x 4096."""
    rows = []
    for m, fns, nbytes in ring_calls(name, ms, dtype, ring_bytes):
        times = wall_seconds(fns, reps)
        rows.append((m, times[0], times[len(times) // 4], nbytes))
    return rows


def _cpu_time_cells(tree: str, args) -> dict[tuple[str, int], tuple[float, int]]:
    """{(format, M): (CPU s per call, stored bytes)} of `--cpu-time --threads 1` run on `tree`'s torchqkit."""
    cmd = [sys.executable, os.path.abspath(__file__), "--formats", args.formats, "--ms", args.ms, "--threads", "1",
           "--cpu-time", "--reps", str(args.reps), "--raw"] + (["--bf16"] if args.bf16 else [])
    env = {**os.environ, "PYTHONPATH": tree}
    lines = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()
    cells = {}
    for line in lines:
        if line.startswith("raw "):
            _, name, m, t, nbytes = line.split()
            cells[(name, int(m))] = (float(t), int(nbytes))
    return cells


def compare(args):
    """Before (args.compare's tree) / after (this tree) medians of --rounds alternating runs, one table."""
    from bench_linear import read_bandwidth  # a sibling file: benchmarks/ is sys.path[0] when run as a script
    trees = {"before": os.path.abspath(args.compare), "after": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    runs = {label: [] for label in trees}
    for r in range(args.rounds):
        for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
            runs[label].append(_cpu_time_cells(trees[label], args))
    bw = read_bandwidth()
    torch.set_num_threads(1)
    bw1 = read_bandwidth()  # what one core reads: the ceiling of the "after GB/s (one core)" column
    from torchqkit import kernels
    print(f"{kernels.cpu_backend('torchqkit::linear_nf4wo')[0]}, 4096 x 4096, {'bf16' if args.bf16 else 'f32'} "
          f"activations, 1 thread, CPU ms per call (median of {args.rounds} alternating runs of {args.reps} calls, "
          f"weights from a ring > 3x L3); read bandwidth of this run: {bw:.1f} GB/s (all threads), {bw1:.1f} GB/s "
          f"(one thread)")
    print("| format | M | before ms | after ms | speed-up | after GB/s (one core) | of all threads' read bw |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key in runs["after"][0]:
        before = statistics.median(run[key][0] for run in runs["before"])
        after = statistics.median(run[key][0] for run in runs["after"])
        gbs = runs["after"][0][key][1] / after / 1e9
        print(f"| {FORMATS[key[0]][1]} | {key[1]} | {before * 1e3:.3f} | {after * 1e3:.3f} | {before / after:.2f}x | "
              f"{gbs:.1f} | {gbs / bw:.0%} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="nf4,fp8,mxfp4,int3", help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--ms", default="1,8", help="batch sizes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 activations instead of float32")
    ap.add_argument("--cpu-time", action="store_true",
                    help="mean CPU time per call of this thread (time.thread_time) instead of wall-clock calls; "
                         "the A/B figure on a shared host (needs --threads 1)")
    ap.add_argument("--compare", metavar="OLD_TREE", help="before / after table against OLD_TREE's torchqkit (--cpu-time)")
    ap.add_argument("--rounds", type=int, default=3, help="--compare: alternating runs per tree")
    ap.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # --compare's machine-readable lines
    args = ap.parse_args()
    if args.compare:
        if not args.cpu_time:
            ap.error("--compare times CPU per call: add --cpu-time")
        return compare(args)
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time counts this thread's CPU time only: run it with --threads 1")
    torch.set_num_threads(args.threads)
    from torchqkit import kernels
    print(f"{args.threads} thread(s), 4096 x 4096, {'bf16' if args.bf16 else 'f32'} activations, "
          f"{kernels.cpu_backend('torchqkit::linear_nf4wo')[0]}; ms of the fastest / 25th-percentile call")
    ms = [int(m) for m in args.ms.split(",")]
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.cpu_time:
        print("  (--cpu-time: mean CPU ms per call of this thread instead)")
        for name in args.formats.split(","):
            for m, t, nbytes in ring_cpu_time(name, ms, args.reps, dtype):
                if args.raw:
                    print(f"raw {name} {m} {t!r} {nbytes}", flush=True)
                    continue
                print(f"  {name:6} M={m:<3} {t * 1e3:7.3f} ms CPU   {nbytes / t / 1e9:5.1f} GB/s", flush=True)
        return
    for name in args.formats.split(","):
        for m, t0, t25, nbytes in ring_timings(name, ms, args.reps, dtype):
            print(f"  {name:6} M={m:<3} {t0 * 1e3:7.3f} / {t25 * 1e3:7.3f} ms   {nbytes / t0 / 1e9:5.1f} / "
                  f"{nbytes / t25 / 1e9:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
