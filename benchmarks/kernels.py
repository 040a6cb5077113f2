"""Quantized linear kernels on CPU: each config's op (called directly on its layout's bytes) next to fp32 / bf16
F.linear and torch's native int8 / int4 ops, per (K, N) and M, in one run.

    python -m benchmarks kernels              # (K,N) in (4096,4096),(4096,11008),(11008,4096); M in 1,8,32,256
    python -m benchmarks kernels --quick                          # 1024 x 1024, M in 1, 32 (seconds)
    python -m benchmarks kernels --configs nf4-b64,fp8-wo,mxfp4 --ms 1,8 --threads 1 --stat min   # decode kernels
    python -m benchmarks kernels --threads 1 --cpu-time --ms 1,8   # CPU time per call: before / after on a loaded host
    python -m benchmarks kernels --compare OLD_TREE --configs nf4-b64,fp8-wo --ms 1,8   # that, on two trees at once
    python -m benchmarks kernels --fp32-precision                 # also under set_float32_matmul_precision("medium")
    python -m benchmarks kernels --shapes 576:1536,1536:576 --configs int4-wo-g32,int4-wo-g32+tiles8 --hot
    python -m benchmarks kernels --routes --configs int4-wo-g128,int8-wo --ms 1,64,256   # each route pinned too
    python -m benchmarks kernels --device cuda                    # the GPU table (refuses to run without a GPU)
    python -m benchmarks kernels --device cuda --dry-run          # its code on CPU, interpreted (no figures)

Decode rows (M <= 8) call each time on the next copy of the weight from a ring of copies > 3x L3, so the weight comes
from memory (common/timing.py); --hot reuses one cached copy (the kernel's compute, apart from the memory bus). GB/s
counts the weight's stored bytes (codes + scales) per call; every record carries the read bandwidth measured by this
run (a sum over the same ring size) and each op's share of it. "x fp32" = fp32 F.linear time / the op's, same run.
The torchqkit rows run the route each case measured fastest at its first call (Note [Routes chosen by measurement]);
--routes adds a row per route pinned (TORCHQKIT_CPU_INT4_DECODE / TORCHQKIT_CPU_FP32_PREFILL) and prints what each
case chose, so the choice can be checked against the same run's times.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch
import torch.nn.functional as F

from .common import cli
from .common.memory import QUICK_BYTES, QUICK_RING, RING_BYTES, read_bandwidth
from .common.timing import STATS, Timer
from .common.weights import direct_call, preset_weight, stored_bytes
from torchqkit.kernels.precision import float32_matmul_precision

GROUP = "kernels"
FULL_SHAPES, FULL_MS = [(4096, 4096), (4096, 11008), (11008, 4096)], [1, 8, 32, 256]
DEFAULT_CONFIGS = ["int8-wo", "int8-dyn-int8", "int4-wo-g128", "int8-dyn-int4-g32+g128", "nf4-b64", "nf4-b64-dq",
                   "fp8-wo", "mxfp4", "mxfp8", "intx4-wo-sym-g32+bits3"]
QUICK_CONFIGS = ["int8-wo", "int4-wo-g128", "nf4-b64", "fp8-wo"]
ACTS = {"f32": torch.float32, "bf16": torch.bfloat16}


def _args(argv):
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--shapes", default=None, help="K:N pairs, e.g. 4096:4096,4096:11008")
    p.add_argument("--ms", default=None, help="batch sizes (rows of x), e.g. 1,8,32,256")
    p.add_argument("--reps", type=int, default=5, help="minimum timed calls per cell")
    p.add_argument("--budget", type=float, default=1.0, help="seconds per cell beyond the minimum calls")
    p.add_argument("--stat", choices=sorted(STATS), default="median",
                   help="a cell's figure: the median call, the fastest (min) or the 25th percentile (a loaded host)")
    p.add_argument("--cpu-time", action="store_true", help="time each call as this thread's CPU time (--threads 1)")
    p.add_argument("--hot", action="store_true", help="decode rows reuse one (cached) weight instead of the ring")
    p.add_argument("--no-native", action="store_true", help="skip torch's _weight_int8pack_mm / int4pack ops")
    p.add_argument("--routes", action="store_true",
                   help="also time each kernel route pinned (float32 x) and print the routes each case chose")
    p.add_argument("--fp32-precision", action="store_true",
                   help="also time F.linear and each op's float32 activations under float32 matmul precision "
                        "'medium' (bf16 compute allowed)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the GPU table (kernels_cuda.py; default shapes 4096:4096,8192:28672, M 1,16,256, bf16)")
    p.add_argument("--dry-run", action="store_true",
                   help="--device cuda without a GPU: the GPU table's code on CPU tensors under TRITON_INTERPRET=1, "
                        "tiny shapes, rows marked as dry-run (never GPU figures); .ci/gpu_check.sh --dry-run")
    p.add_argument("--peak-gbs", type=float, default=None, help="--device cuda: the GPU's peak DRAM GB/s")
    p.add_argument("--compare", metavar="OLD_TREE", default=None,
                   help="before / after: CPU time per call on OLD_TREE's torchqkit and this one (kernels_compare.py)")
    p.add_argument("--rounds", type=int, default=3, help="--compare: alternating runs per tree (default 3)")
    args, rec = cli.start(GROUP, p, argv)
    if args.cpu_time and torch.get_num_threads() != 1 and not args.compare:
        p.error("--cpu-time counts this thread's CPU time only: add --threads 1")
    if args.dry_run and args.device != "cuda":
        p.error("--dry-run rehearses the GPU table: add --device cuda")
    cli.quick(args, argv, reps=3, budget=0.0, configs=QUICK_CONFIGS)
    if args.device == "cuda":
        from .kernels_cuda import default_shapes
        full_shapes, full_ms, quick_shapes, quick_ms = default_shapes(args.dry_run)
    else:
        full_shapes, full_ms, quick_shapes, quick_ms = FULL_SHAPES, FULL_MS, [(1024, 1024)], [1, 32]
    args.shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else
                   quick_shapes if args.quick else full_shapes)
    args.ms = [int(v) for v in args.ms.split(",")] if args.ms else quick_ms if args.quick else full_ms
    return args, rec


def torch_int4_pack(aqt, k: int, n: int, group: int):
    """(packed codes, scale_and_zero) of a TensorCoreTiledLayout weight as torch._weight_int4pack_mm_for_cpu takes
    them (torch's own ISA-dependent packing), for a side-by-side with torchqkit's op on the same codes."""
    codes = aqt.qlayout.unpack(aqt).qdata.to(torch.int32)
    sz = aqt.scale_and_zero[: k // group, :n].to(torch.bfloat16).contiguous()  # the op takes bf16 scales and zeros
    return torch._convert_weight_to_int4pack_for_cpu(codes, 8), sz


def _native(name: str, q, k: int, n: int, xb: torch.Tensor):
    """(case, fn(weight tensors...), weight tensors) of torch's own op on `q`'s codes, or None where torch has none."""
    if name == "int8-wo":
        sb = q.scale.reshape(n).bfloat16()
        return "torch._weight_int8pack_mm", (lambda c: torch._weight_int8pack_mm(xb, c, sb)), (q.qdata,)
    group = q.block_size[1]
    if name.startswith("int4-wo-g") and "+" not in name and k % group == 0:
        packed, sz = torch_int4_pack(q, k, n, group)
        return ("torch._weight_int4pack_mm_for_cpu",
                (lambda pk, s: torch._weight_int4pack_mm_for_cpu(xb, pk, group, s)), (packed, sz))
    return None


def _torchao_int8(w: torch.Tensor):
    """An nn.Linear holding w quantized by torchao's Int8WeightOnlyConfig, when torchao is installed (a peer)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    import torchao.quantization as aoq
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    aoq.quantize_(lin, aoq.Int8WeightOnlyConfig())
    return lin


def _pinned_routes(op: str, m: int) -> list[tuple[str, str]]:
    """The routes a weight-only op can be pinned to for M float32 rows (Note [Routes chosen by measurement]): the int4
    decode kernels of one token; the float32 prefill's GEMMs, for the ops whose C++ description says they have them,
    from the M where both serve (AVX2 int4: 16)."""
    from torchqkit import kernels
    if op == "torchqkit::linear_int4wo_tiled" and m == 1:
        return [("TORCHQKIT_CPU_INT4_DECODE", r) for r in ("float", "int16")]
    if kernels.cpu_kernel_descriptions().get(op, {}).get("fp32_prefill_routes") and m >= 16:
        return [("TORCHQKIT_CPU_FP32_PREFILL", r) for r in ("panels", "sgemm")]
    return []


@contextlib.contextmanager
def _env(variable: str, value: str):
    saved = os.environ.get(variable)
    os.environ[variable] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(variable)
        else:
            os.environ[variable] = saved


def _print_routes() -> None:
    from torchqkit import kernels
    print("routes measured at each case's first call (median us per route):")
    for r in kernels.routes():
        times = ", ".join(f"{name} {us:.0f}" for name, us in r["median_us"].items())
        print(f"  {r['op'].split('::')[-1]} {r['isa']} {r['dtype']} M {r['m']} N {r['n']} K {r['k']}: "
              f"{r['site']} = {r['choice']} ({times}; rule {r['rule']})")


class _Cell:
    """Records of one (K, N, M): times against this cell's fp32 F.linear and the run's read bandwidth."""

    def __init__(self, rec, k, n, m, t32):
        self.rec, self.shape, self.t32 = rec, {"K": k, "N": n, "M": m}, t32

    def add(self, case, config, seconds, nbytes, **extra):
        self.rec.add(case, config, self.shape, "time", seconds * 1e3, "ms", **extra)
        self.rec.add(case, config, self.shape, "x fp32 F.linear", self.t32 / seconds, "x", **extra)
        if nbytes:
            gbs = nbytes / seconds / 1e9
            self.rec.add(case, config, self.shape, "weight read", gbs, "GB/s", **extra)
            self.rec.add(case, config, self.shape, "of read bandwidth", 100 * gbs / self.rec.read_bw_gbs, "%", **extra)


def measure_shape(k, n, args, rec, timer):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    weights = {name: preset_weight(name, w) for name in args.configs if name not in ("float32", "bfloat16")}
    ao = _torchao_int8(w) if "int8-wo" in weights else None
    for m in args.ms:
        x = torch.randn(m, k, generator=g)
        xs = {a: x.to(dt) for a, dt in ACTS.items()}
        cold = m <= 8 and not args.hot
        t32 = timer(lambda w: F.linear(x, w), w, cold=cold)
        cell = _Cell(rec, k, n, m, t32)
        cell.add("F.linear, f32 x", "float32", t32, stored_bytes(w))
        wb = w.bfloat16()
        cell.add("F.linear, bf16 x", "bfloat16", timer(lambda w: F.linear(xs["bf16"], w), wb, cold=cold),
                 stored_bytes(wb))
        if args.fp32_precision:
            with float32_matmul_precision("medium"):
                cell.add("F.linear, f32 x, precision medium", "float32", timer(lambda w: F.linear(x, w), w, cold=cold),
                         stored_bytes(w))
        for name, q in weights.items():
            nbytes = stored_bytes(q)
            for act, xa in xs.items():
                fn, op = direct_call(q, xa)
                cell.add(f"torchqkit, {act} x", name, timer(fn, q, cold=cold), nbytes, op=op)
            if args.fp32_precision:
                with float32_matmul_precision("medium"):
                    fn, op = direct_call(q, x)
                    cell.add("torchqkit, f32 x, precision medium", name, timer(fn, q, cold=cold), nbytes, op=op)
            if args.routes:
                for variable, route in _pinned_routes(op, m):
                    with _env(variable, route):
                        fn, _ = direct_call(q, x)
                        cell.add(f"torchqkit, f32 x, {variable}={route}", name, timer(fn, q, cold=cold), nbytes, op=op)
            native = None if args.no_native else _native(name, q, k, n, xs["bf16"])
            if native is not None:
                case, fn, tensors = native
                cell.add(f"{case}, bf16 x", name, timer(fn, *tensors, cold=cold), sum(map(stored_bytes, tensors)))
        if ao is not None:
            with torch.no_grad():
                cell.add("torchao Int8WeightOnlyConfig, f32 x", "int8-wo", timer(lambda mod: mod(x), ao, cold=cold,
                                                                                 nbytes=n * k + 4 * n), n * k + 4 * n)


def main(argv=None) -> int:
    args, rec = _args(argv)
    if args.device == "cuda":
        from . import kernels_cuda
        return kernels_cuda.main(args, rec)
    if args.compare:
        from . import kernels_compare
        rec.read_bw_gbs = read_bandwidth(nbytes=QUICK_BYTES if args.quick else RING_BYTES)
        return kernels_compare.main(args, rec)
    ring, probe = (QUICK_RING, QUICK_BYTES) if args.quick else (RING_BYTES, RING_BYTES)
    timer = Timer(min_reps=args.reps, budget_s=args.budget, stat=args.stat, cpu_time=args.cpu_time, ring_bytes=ring)
    rec.read_bw_gbs = read_bandwidth(stat=STATS[args.stat], nbytes=probe)
    print(f"read bandwidth {rec.read_bw_gbs:.1f} GB/s (sum over {probe >> 20} MiB, this run); "
          f"{torch.get_num_threads()} threads; {args.stat} of calls")
    for k, n in args.shapes:
        measure_shape(k, n, args, rec, timer)
    rec.print_table()
    if args.routes:
        _print_routes()
    print(f"read bandwidth at the end: {read_bandwidth(stat=STATS[args.stat], nbytes=probe):.1f} GB/s")
    return 0
