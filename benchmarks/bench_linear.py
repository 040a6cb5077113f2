"""Quantized linear on CPU: torchqkit's int8 / int4 kernels next to fp32 / bf16 F.linear and torch's native int8 op.

    python benchmarks/bench_linear.py            # (K,N) in (4096,4096),(4096,11008),(11008,4096); M in 1,8,32,256
    python benchmarks/bench_linear.py --quick    # one small shape, CI-sized (seconds)
    python benchmarks/bench_linear.py --fp32-precision --formats int8,int4,nf4,fp8,mxfp4,int3 --ms 1,8,256
        # float32 activations at the default fp32 matmul precision and under "medium" (bf16 compute allowed)
    python benchmarks/bench_linear.py --fp32-precision --threads 1 --cpu-time ...   # the same, on a loaded host

One run prints one table. Times are medians in ms (--stat min: the fastest call). Decode rows (M <= 8) time each call on its own copy
of the weight, taken in turn from a ring of copies that together exceed 3x the L3 cache, so the weight
comes from memory while the code, the activation and the threads stay warm, as for the layers of a
decoder step. (Flushing the caches before each call instead also charges every call 0.1-0.2 ms of
cold Python / dispatcher / thread wake-up that no model sees.) The read bandwidth the "GB/s" column is
compared with is measured by the same run, as a sum over a buffer of 3x L3 (at least 96 MiB) after a
flush (these hosts are shared, and their bandwidth drifts). GB/s counts the weight bytes (codes + scales) only.

Columns: f32 / bf16 = F.linear with a float weight; i8pack = torch._weight_int8pack_mm (bf16 activations);
wo = torchqkit::linear_int8wo_plain (per-channel) with f32 / bf16 activations; da8 = torchqkit::
linear_int8da_int8_plain (per-token symmetric activations, f32 in/out); xf32 = f32 time / da8 time;
ao8 = torchao's Int8WeightOnlyConfig on an nn.Linear with f32 activations, when torchao is installed
(`pip install --no-deps torchao`, 0.18 here; nan otherwise). torchao's int4 configs are tried once and
their refusal on CPU is printed.
int4 table (--formats int4): i4pack = torch._weight_int4pack_mm_for_cpu with bf16 activations (torch's
ISA-dependent packing), i4 f32 / i4 bf16 = torchqkit::linear_int4wo_tiled on TensorCoreTiledLayout bytes,
da4 = torchqkit::linear_int8da_int4_packed (int8 dynamic activations x PackedIntxLayout int4, VNNI).
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import torchqkit
from torchqkit import kernels
from torchqkit.kernels.precision import float32_matmul_precision

FULL_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]
FULL_MS = [1, 8, 32, 256]


def l3_bytes() -> int:
    """The last-level cache this CPU reports (sysfs), or 32 MiB when it doesn't say. A VM may report the host's
    whole L3 (480 MiB on one Xeon here) of which it holds less: 3x it is on the safe side."""
    try:
        size = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return 32 * 2**20
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
    return int(size.rstrip("KMG")) * scale


# Bytes that no cache holds: weights read in turn from a ring of copies this large, and the read-bandwidth probe's
# buffer, come from memory.
RING_BYTES = max(96 * 2**20, 3 * l3_bytes())
FLUSH = torch.empty(max(128 * 2**20, l3_bytes()) // 4)  # float32 written over the caches
# How a cell's calls become one figure: the median, or with --stat min the fastest call (on a host shared with
# other jobs, the median measures the neighbours; the fastest call is what the kernel itself needs).
STAT = {"median": statistics.median, "min": min}
_stat = statistics.median
# --cpu-time (with --threads 1): each call's figure is this thread's CPU time (time.thread_time), which time spent
# descheduled by a loaded host's other jobs does not inflate; otherwise wall-clock time.
_clock = time.perf_counter


def _flush():
    FLUSH.add_(1.0)


def _nbytes(t) -> int:
    if isinstance(t, torchqkit.AffineQuantizedTensor):
        from bench_lowbit import stored_bytes  # a sibling file: benchmarks/ is sys.path[0] when run as a script
        return stored_bytes(t)
    return t.numel() * t.element_size()


def bench(fn, *weights, cold: bool, min_reps: int, budget_s: float, nbytes: int | None = None) -> float:
    """Median seconds of fn(*weights) over at least min_reps calls (more while under budget_s).

    cold: each call gets the next copy of `weights` from a ring of copies of RING_BYTES or more, so the
    weights come from memory (see the module docstring); else every call reuses the same (cached) weights.
    nbytes: the stored bytes of one copy when `weights` aren't tensors (e.g. another library's module)."""
    fn(*weights)  # warm-up: allocations, lazy init (before the copies: the ring starts with the oldest)
    ring = [weights]
    if cold:
        per_copy = max(1, nbytes or sum(_nbytes(w) for w in weights))
        ring += [tuple(copy.deepcopy(w) for w in weights) for _ in range(-(-RING_BYTES // per_copy) - 1)]
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 50):
        args = ring[len(times) % len(ring)]
        t0 = _clock()
        fn(*args)
        times.append(_clock() - t0)
    return _stat(times)


def read_bandwidth(reps: int = 7) -> float:
    """GB/s of a parallel read-only pass over a fresh buffer of RING_BYTES after a flush (not FLUSH: it must not
    be cached)."""
    buf = torch.ones(RING_BYTES // 4)
    times = []
    for _ in range(reps):
        _flush()
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / _stat(times) / 1e9


def cpu_model() -> str:
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _torchao():
    """torchao.quantization, or None when torchao isn't installed (it is an optional baseline)."""
    try:
        import torchao.quantization as aoq
    except ImportError:
        return None
    return aoq


def torchao_linear(w: torch.Tensor, config):
    """An nn.Linear holding w, quantized in place by torchao's quantize_ with `config`."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    _torchao().quantize_(lin, config)
    return lin


def torchao_int4_status() -> str:
    """Whether torchao's int4 weight-only config quantizes on this CPU (a one-line reason if not)."""
    aoq = _torchao()
    if aoq is None:
        return "torchao not installed"
    try:
        torchao_linear(torch.randn(256, 256).bfloat16(), aoq.Int4WeightOnlyConfig(group_size=128))
    except Exception as e:  # noqa: BLE001 - any refusal is the finding being reported
        return f"torchao int4 refuses on CPU: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return "torchao int4 quantizes on CPU (not timed by this script)"


def row(k, n, m, bw, args):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=g)
    wb, xb, sb = w.bfloat16(), x.bfloat16(), scale.reshape(n).bfloat16()
    opts = dict(cold=m <= 8 and not args.hot, min_reps=args.reps, budget_s=args.budget)
    wo, da = torch.ops.torchqkit.linear_int8wo_plain, torch.ops.torchqkit.linear_int8da_int8_plain
    t = {
        "f32": bench(lambda w: F.linear(x, w), w, **opts),
        "bf16": bench(lambda w: F.linear(xb, w), wb, **opts),
        "i8pack": (bench(lambda q: torch._weight_int8pack_mm(xb, q, sb), q, **opts) if not args.no_native
                   else float("nan")),
        "wo f32": bench(lambda q: wo(x, q, scale, None), q, **opts),
        "wo bf16": bench(lambda q: wo(xb, q, scale, None), q, **opts),
        "da8": bench(lambda q: da(x, q, scale, None, True), q, **opts),
        "ao8": float("nan"),
    }
    if _torchao() is not None:
        lin = torchao_linear(w, _torchao().Int8WeightOnlyConfig())
        with torch.no_grad():
            t["ao8"] = bench(lambda mod: mod(x), lin, **opts, nbytes=n * k + n * 4)
    weight_bytes = n * k + n * 4
    gbs = weight_bytes / t["wo f32"] / 1e9
    cells = [f"{k:>5} {n:>5} {m:>4}"] + [f"{v * 1e3:9.2f}" for v in t.values()]
    cells += [f"{gbs:6.1f} ({gbs / bw:4.0%})", f"{t['f32'] / t['da8']:5.1f}x", f"{t['f32'] / t['wo f32']:5.1f}x"]
    return "  ".join(cells)


def torch_int4_pack(aqt, k: int, n: int, group: int):
    """(packed codes, scale_and_zero) of a TensorCoreTiledLayout weight as torch._weight_int4pack_mm_for_cpu takes
    them (torch's own packing for the CPU it runs on), for a side-by-side with torchqkit's op on the same codes."""
    codes = aqt.qlayout.unpack(aqt).qdata.to(torch.int32)
    return torch._convert_weight_to_int4pack_for_cpu(codes, 8), aqt.scale_and_zero[: k // group, :n].contiguous()


def int4_row(k, n, m, bw, args, group=128):
    """int4 weight-only, group size `group`: torch's native _weight_int4pack_mm_for_cpu (bf16 activations; its own
    packing) next to torchqkit::linear_int4wo_tiled on TensorCoreTiledLayout(8) bytes with f32 / bf16 activations."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).bfloat16()
    aqt = torchqkit.quantize_weight(w, torchqkit.qdtypes.uint4, torchqkit.PerGroup(group),
                                    torchqkit.TensorCoreTiledLayout(inner_k_tiles=8), mapping="asymmetric",
                                    zero_point_domain="float")
    x = torch.randn(m, k, generator=g)
    wf, xb = aqt.dequantize().float(), x.bfloat16()
    opts = dict(cold=m <= 8 and not args.hot, min_reps=args.reps, budget_s=args.budget)
    op = torch.ops.torchqkit.linear_int4wo_tiled
    t = {
        "f32": bench(lambda w: F.linear(x, w), wf, **opts),
        "bf16": bench(lambda w: F.linear(xb, w), wf.bfloat16(), **opts),
        "i4pack": float("nan"),
        "i4 f32": bench(lambda q, sz: op(x, q, sz, group, n, None), aqt.qdata, aqt.scale_and_zero, **opts),
        "i4 bf16": bench(lambda q, sz: op(xb, q, sz, group, n, None), aqt.qdata, aqt.scale_and_zero, **opts),
    }
    act = torchqkit.ActivationQuantSpec(torchqkit.qdtypes.int8, torchqkit.PerToken(), "asymmetric")
    da = torchqkit.quantize_weight(w, torchqkit.qdtypes.int4, torchqkit.PerGroup(group), torchqkit.PackedIntxLayout(),
                                   mapping="symmetric", act_quant=act)
    da4 = torch.ops.torchqkit.linear_int8da_int4_packed
    t["da4"] = bench(lambda q, s: da4(x, q, s, None, None, False), da.qdata, da.scale, **opts)
    if not args.no_native:
        packed, sz = torch_int4_pack(aqt, k, n, group)
        t["i4pack"] = bench(lambda pk, sz: torch._weight_int4pack_mm_for_cpu(xb, pk, group, sz), packed, sz, **opts)
    nbytes = aqt.qdata.numel() * 4 + aqt.scale_and_zero.numel() * aqt.scale_and_zero.element_size()
    gbs = [nbytes / t[c] / 1e9 for c in ("i4 f32", "i4 bf16")]
    cells = [f"{k:>5} {n:>5} {m:>4}"] + [f"{v * 1e3:9.2f}" for v in t.values()]
    cells += [f"{v:6.1f} ({v / bw:4.0%})" for v in gbs]
    cells += [f"{t['f32'] / t['i4 f32']:5.1f}x", f"{t['i4pack'] / t['i4 bf16']:6.1f}x", f"{t['f32'] / t['da4']:5.1f}x"]
    return "  ".join(cells)


def int4_table(shapes, ms, bw, args):
    g = args.int4_group
    odd = [k for k, _ in shapes if k % g]
    if odd:  # the ops are called directly here, without the layouts' padding of x to whole groups
        raise SystemExit(f"--formats int4 times the ops on g{g} weights: K must be a multiple of {g}, got {odd} "
                         f"(a quantized model pads x itself; time such shapes through the model)")
    print(torchao_int4_status())
    print(f"int4 g{g} (bf16 weights): i4pack = torch._weight_int4pack_mm_for_cpu (bf16 x); i4 = torchqkit::"
          "linear_int4wo_tiled (TensorCoreTiledLayout(8)); da4 = torchqkit::linear_int8da_int4_packed (f32 x, "
          "asymmetric per-token int8, PackedIntxLayout int4 symmetric); GB/s counts codes + scale/zero bytes")
    head = ["    K     N    M"] + [f"{c:>9}" for c in ("f32", "bf16", "i4pack", "i4 f32", "i4 bf16", "da4")]
    head += ["i4 f32 GB/s (bw%)", "i4 bf16 GB/s (bw%)", " i4 xf32", " i4pack/i4", " da4 xf32"]
    print("  ".join(head) + f"    [ms, {args.stat}]")
    for k, n in shapes:
        for m in ms:
            print(int4_row(k, n, m, bw, args, g), flush=True)


def _precision_weight(name: str, k: int, n: int):
    """(call(x), stored weight tensors for the ring, stored bytes) of format `name` at (n, k)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    if name == "int8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
        return (lambda x, q, s: torch.ops.torchqkit.linear_int8wo_plain(x, q, s, None)), (q, s), n * k + 4 * n
    if name == "int4":
        aqt = torchqkit.quantize_weight(w.bfloat16(), torchqkit.qdtypes.uint4, torchqkit.PerGroup(128),
                                        torchqkit.TensorCoreTiledLayout(inner_k_tiles=8), mapping="asymmetric",
                                        zero_point_domain="float")
        op = torch.ops.torchqkit.linear_int4wo_tiled
        nbytes = aqt.qdata.numel() * 4 + aqt.scale_and_zero.numel() * aqt.scale_and_zero.element_size()
        return (lambda x, q, sz: op(x, q, sz, 128, n, None)), (aqt.qdata, aqt.scale_and_zero), nbytes
    from bench_lowbit import FORMATS, call, stored_bytes  # a sibling file: benchmarks/ is sys.path[0]
    aqt = FORMATS[name][0](w)
    return (lambda x, a: call(a, x)()), (aqt,), stored_bytes(aqt)


def precision_table(shapes, ms, bw, names, args):
    """--fp32-precision: every format's op with float32 activations at torch's default fp32 matmul precision and under
    "medium" (which lets fp32 matmuls compute in bf16: the ops then take their bf16 kernels from the prefill M on,
    on AVX512-BF16 CPUs), next to F.linear both ways and the op on bf16 activations."""
    print("float32 activations and torch.set_float32_matmul_precision: f32 = F.linear at the default ('highest'), "
          "f32 med = F.linear under 'medium' (oneDNN in bf16); op f32 / op med = the format's op on float32 x at "
          "'highest' / 'medium'; op bf16 = on bfloat16 x; x = f32 F.linear (highest) time / the op's; int4 = int4 g128 "
          "tiled, int8 = int8 per channel; the low-bit formats as in their table")
    head = ["format    K     N    M"] + [f"{c:>8}" for c in ("f32", "f32 med", "op f32", "op med", "op bf16")]
    head += ["op f32 (bw%)", "op bf16 (bw%)", "x f32", "x med", "x bf16"]
    print("  ".join(head) + f"    [ms, {args.stat}]")
    for k, n in shapes:
        for name in names:
            fn, weights, nbytes = _precision_weight(name, k, n)
            for m in ms:
                opts = dict(cold=m <= 8 and not args.hot, min_reps=args.reps, budget_s=args.budget, nbytes=nbytes)
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                wf, xb = torch.randn(n, k) * 0.02, x.bfloat16()
                t = {"f32": bench(lambda w: F.linear(x, w), wf, **opts)}
                with float32_matmul_precision("medium"):
                    t["f32 med"] = bench(lambda w: F.linear(x, w), wf, **opts)
                t["op f32"] = bench(lambda *w: fn(x, *w), *weights, **opts)
                with float32_matmul_precision("medium"):
                    t["op med"] = bench(lambda *w: fn(x, *w), *weights, **opts)
                t["op bf16"] = bench(lambda *w: fn(xb, *w), *weights, **opts)
                cells = [f"{name:6} {k:>5} {n:>5} {m:>4}"] + [f"{v * 1e3:8.2f}" for v in t.values()]
                cells += [f"{nbytes / t[c] / 1e9:5.1f} ({nbytes / t[c] / 1e9 / bw:4.0%})" for c in ("op f32", "op bf16")]
                cells += [f"{t['f32'] / t[c]:5.1f}x" for c in ("op f32", "op med", "op bf16")]
                print("  ".join(cells), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small shape and M in (1, 32): runs in seconds")
    p.add_argument("--shapes", default=None, help="K:N pairs, e.g. 4096:4096,4096:11008")
    p.add_argument("--ms", default=None, help="batch sizes, e.g. 1,8,32,256")
    p.add_argument("--reps", type=int, default=5, help="minimum timed calls per cell")
    p.add_argument("--budget", type=float, default=1.0, help="seconds per cell beyond the minimum reps")
    p.add_argument("--no-native", action="store_true", help="skip torch._weight_int8pack_mm")
    p.add_argument("--formats", default="int8,int4",
                   help="tables to print: int8 (the columns above), int4 (int4_table) and/or low-bit weight-only formats of "
                        "bench_lowbit.py (nf4, nf4dq, fp8, e5m2, int2..int6, mxfp4, mxfp8), e.g. int8,nf4,fp8,int3")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the GPU table of bench_linear_cuda.py (refuses to run without a GPU)")
    p.add_argument("--peak-gbs", type=float, default=None, help="--device cuda: the GPU's peak DRAM GB/s")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own, 2 here)")
    p.add_argument("--fp32-precision", action="store_true",
                   help="instead of the tables above, one table per --formats entry (int8, int4, low-bit names) of the "
                        "op with float32 activations at torch's default fp32 matmul precision and under 'medium' "
                        "(bf16 compute allowed), next to F.linear both ways and the op on bf16 activations")
    p.add_argument("--hot", action="store_true",
                   help="decode rows reuse one weight (cached): the kernel's compute speed, apart from the memory bus "
                        "(which other jobs on a shared host also load)")
    p.add_argument("--stat", choices=sorted(STAT), default="median",
                   help="min: the fastest call of each cell and the fastest bandwidth pass (a shared, loaded host)")
    p.add_argument("--int4-group", type=int, default=128, choices=(32, 64, 128, 256),
                   help="group size of the int4 table's weights (default 128)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time each call as this thread's CPU time (needs --threads 1): the before / after figure on a "
                        "loaded shared host, where wall time measures the other jobs")
    args = p.parse_args()
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time counts this thread's CPU time only: run it with --threads 1")
    global _stat, _clock
    _stat = STAT[args.stat]
    if args.cpu_time:
        _clock = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes, ms = FULL_SHAPES, FULL_MS
    if args.quick:
        shapes, ms, args.reps, args.budget = [(1024, 1024)], [1, 32], 3, 0.0
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]

    if args.device == "cuda":  # a sibling file: benchmarks/ is sys.path[0] when run as a script
        from bench_linear_cuda import main_cuda
        return main_cuda(args, shapes, ms)

    torch.manual_seed(0)
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"torchqkit {torchqkit.__version__}")
    for op in ("torchqkit::linear_int8wo_plain", "torchqkit::linear_int8da_int8_plain"):
        path, why = kernels.cpu_backend(op)
        print(f"  {op}: {path} ({why})")
    bw = read_bandwidth()
    where = ("reuse one cached weight (--hot)" if args.hot else
             f"read their weight from memory (a ring of copies > {RING_BYTES >> 20} MiB)")
    print(f"read bandwidth (sum over {RING_BYTES >> 20} MiB, same run): {bw:.1f} GB/s; decode rows (M <= 8) {where}")
    formats = args.formats.split(",")
    if args.fp32_precision:
        for op in ("torchqkit::linear_int8wo_plain", "torchqkit::linear_nf4wo"):
            with float32_matmul_precision("medium"):
                print(f"  under 'medium', {op}: {' '.join(kernels.cpu_backend(op))}")
        precision_table(shapes, ms, bw, formats, args)
        print(f"read bandwidth at the end: {read_bandwidth():.1f} GB/s")
        return
    if "int8" in formats:
        head = ["    K     N    M"] + [f"{c:>9}" for c in ("f32", "bf16", "i8pack", "wo f32", "wo bf16", "da8", "ao8")]
        head += ["wo GB/s (bw%)", " da8 xf32", " wo xf32"]
        print("  ".join(head) + f"    [ms, {args.stat}]")
        for k, n in shapes:
            for m in ms:
                print(row(k, n, m, bw, args), flush=True)
    if "int4" in formats:
        int4_table(shapes, ms, bw, args)
    lowbit = [f for f in formats if f not in ("int8", "int4")]
    if lowbit:  # a sibling file: benchmarks/ is sys.path[0] when run as a script
        from bench_lowbit import FORMATS, lowbit_table
        unknown = sorted(set(lowbit) - set(FORMATS))
        if unknown:
            raise SystemExit(f"--formats: unknown {unknown}; known: int8, {', '.join(FORMATS)}")
        lowbit_table(shapes, ms, bw, lowbit, bench, args)
    print(f"read bandwidth at the end: {read_bandwidth():.1f} GB/s")


if __name__ == "__main__":
    main()
