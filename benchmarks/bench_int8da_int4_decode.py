"""torchqkit::linear_int8da_int4_packed at decode sizes (M = 1..4) on small-LLM shapes (SmolLM2-135M by default).

    python benchmarks/bench_int8da_int4_decode.py                       # K:N of SmolLM2, group 32, M = 1
    python benchmarks/bench_int8da_int4_decode.py --group 128 --ms 1,4
    TORCHQKIT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/...   # AVX2 level
    python benchmarks/bench_int8da_int4_decode.py --format q41-token,q41-group      # GGUF Q4_1's weights

--format sym-token (default): what Int8DynamicActivationIntxWeightConfig() stores (PackedIntxLayout int4, symmetric,
float32 scales per group; asymmetric per-token int8 activations); q41-token / q41-group: asymmetric with float zero
points and float16 scales and zeros (Q4_1's grid and 5 bits per weight at g32), activations with one asymmetric
scale per token / one symmetric scale per token and group (Note [int8 x int4 per-group activation scales]). The op
is called directly (the dispatcher's ~5 us is in every figure); x is padded as the layout's linear pads it when K
is not a multiple of the group.
Columns:
  cpu us     one torch thread, the weight reused (hot, in cache): the fastest time.thread_time() of --reps calls,
             so time descheduled by the neighbours of a shared host doesn't count
  GB/s/core  weight bytes (codes + scales) / cpu us: the kernel's compute rate on one core
  f32 us     F.linear with the float weight, same conditions
  2t us      wall clock at --threads2 threads, each call on the next copy of a ring of weight copies larger than
             3x L3 (the weight comes from memory, as for the layers of a decoder step): the fastest call, as the
             bandwidth is the fastest of its passes (on a shared 2-core host a median of 2-thread calls measures the
             neighbours: one thread descheduled for a 12-16 ms time slice)
  2t GB/s    weight bytes / 2t us
  2t bw%     2t GB/s against the read bandwidth measured in the same run (a sum over 3x L3)
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

import torchqkit
import bench_linear  # a sibling file: benchmarks/ is sys.path[0]
from bench_linear import RING_BYTES, cpu_model, read_bandwidth

SMOLLM2_SHAPES = [(576, 192), (576, 576), (576, 1536), (1536, 576), (576, 49152)]


def cpu_time(fn, args, reps: int) -> float:
    """The fastest thread CPU time (s) of fn(*args) over reps calls, after two warm-up calls."""
    fn(*args)
    fn(*args)
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn(*args)
        best = min(best, time.thread_time() - t0)
    return best


def ring_time(fn, args, nbytes: int, reps: int) -> float:
    """Fastest wall-clock seconds of fn over reps calls, each on the next copy from a ring larger than RING_BYTES."""
    fn(*args)
    ring = [args] + [tuple(copy.deepcopy(a) for a in args) for _ in range(-(-RING_BYTES // nbytes) - 1)]
    times = []
    for i in range(max(reps, len(ring))):
        t0 = time.perf_counter()
        fn(*ring[i % len(ring)])
        times.append(time.perf_counter() - t0)
    return min(times)


FORMATS = ("sym-token", "q41-token", "q41-group")


def da4_weight(k: int, n: int, group: int, fmt: str):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    q41, groups = fmt.startswith("q41"), fmt.endswith("group")
    act = torchqkit.ActivationQuantSpec(torchqkit.qdtypes.int8, torchqkit.PerGroup(group) if groups else
                                        torchqkit.PerToken(), "symmetric" if groups else "asymmetric")
    return w, torchqkit.quantize_weight(w, torchqkit.qdtypes.int4, torchqkit.PerGroup(group),
                                        torchqkit.PackedIntxLayout(), mapping="asymmetric" if q41 else "symmetric",
                                        zero_point_domain="float" if q41 else None,
                                        scale_dtype=torch.float16 if q41 else None, act_quant=act)


def row(k: int, n: int, m: int, group: int, fmt: str, bw: float, args) -> str:
    w, aqt = da4_weight(k, n, group, fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    xp = F.pad(x, (0, 2 * aqt.qdata.shape[1] - k))  # the layout pads K to whole groups (576 at g128: 640), as linear does
    op = torch.ops.torchqkit.linear_int8da_int4_packed
    spec = aqt.act_quant
    sym, groups = spec.mapping.value == "symmetric", spec.group_size or 0
    tensors = (aqt.qdata, aqt.scale) + (() if aqt.zero_point is None else (aqt.zero_point,))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    da4 = lambda q, s, z=None: op(xp, q, s, z, None, sym, groups)  # noqa: E731
    torch.set_num_threads(1)
    t1 = cpu_time(da4, tensors, args.reps)
    tf = cpu_time(lambda wf: F.linear(x, wf), (w,), args.reps)
    torch.set_num_threads(args.threads2)
    t2 = ring_time(da4, tensors, nbytes, args.reps)
    return (f"{fmt:>9} {k:>5} {n:>6} {m:>3} {group:>4}  {t1 * 1e6:8.1f}  {nbytes / t1 / 1e9:9.1f}  {tf * 1e6:8.1f}  "
            f"{t2 * 1e6:8.1f}  {nbytes / t2 / 1e9:7.1f}  {nbytes / t2 / 1e9 / bw:6.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="K:N pairs (default: SmolLM2-135M's)")
    ap.add_argument("--ms", default="1", help="tokens per call, e.g. 1,4")
    ap.add_argument("--group", type=int, default=32, help="weight group size (32: the config's default)")
    ap.add_argument("--reps", type=int, default=200, help="calls per cell")
    ap.add_argument("--threads2", type=int, default=2, help="threads of the ring (from-memory) column")
    ap.add_argument("--format", default="sym-token", help=f"comma-separated, of {', '.join(FORMATS)}")
    args = ap.parse_args()
    formats = args.format.split(",")
    if set(formats) - set(FORMATS):
        ap.error(f"--format: unknown {sorted(set(formats) - set(FORMATS))}; known: {', '.join(FORMATS)}")
    shapes = SMOLLM2_SHAPES if not args.shapes else [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    path, why = torchqkit.kernels.cpu_backend("torchqkit::linear_int8da_int4_packed")
    print(f"machine: {cpu_model()}, torch {torch.__version__}; linear_int8da_int4_packed: {path}")
    bench_linear._stat = min  # the fastest bandwidth pass, like the fastest ring call
    bw = read_bandwidth()
    print(f"read bandwidth (sum over {RING_BYTES >> 20} MiB, median of 7, same run): {bw:.1f} GB/s")
    print("   format     K      N   M    g    cpu us  GB/s/core    f32 us     2t us  2t GB/s  2t bw%")
    for k, n in shapes:
        for m in (int(v) for v in args.ms.split(",")):
            for fmt in formats:
                print(row(k, n, m, args.group, fmt, bw, args), flush=True)


if __name__ == "__main__":
    main()
