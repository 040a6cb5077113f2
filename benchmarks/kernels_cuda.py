"""The GPU side of the kernels group (``python -m benchmarks kernels --device cuda``).

Per (K, N, M): median ms of bf16 ``F.linear``, torch's tinygemm ``_weight_int4pack_mm`` (group 128), and each
torchqkit GPU backend (C++ CUDA and Triton, where ``torchqkit.kernels`` says it can serve) of the ops behind the
int4-wo-g128, nf4-b64 and fp8-wo presets, plus torchao's int4 weight-only linear when torchao is installed. Timed with
CUDA events after warm-up; decode rows (M <= 16) flush L2 first. GB/s counts weight bytes (codes + scales) against the
GPU's peak DRAM bandwidth (from its memory clock and bus width, or --peak-gbs), which every record carries as
read_bw_gbs. Without a CUDA device it refuses to run: CPU timings are never recorded as GPU figures. ``--dry-run``
runs the same code on CPU tensors under the Triton interpreter with tiny shapes (what ``.ci/gpu_check.sh --dry-run``
rehearses in CI); its rows say "dry run" in their case and carry no bandwidth.

Default shapes (K, N): 4096 x 4096 and 8192 x 28672 (a 70B-class MLP up-projection), M = 1, 16, 256.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from torchqkit import kernels
from torchqkit.tensor.activation import KernelPreference

from .common.weights import preset_weight, stored_bytes

# preset -> the op its weight routes to on the GPU, and that op's arguments after x
OPS = {
    "int4-wo-g128": ("torchqkit::linear_int4wo_tiled", lambda q, n: (q.qdata, q.scale_and_zero, 128, n)),
    "int8-wo": ("torchqkit::linear_int8wo_plain", lambda q, n: (q.qdata, q.scale)),
    "nf4-b64": ("torchqkit::linear_nf4wo", lambda q, n: (q.qdata, q.scale, None, None, None, 64)),
    "fp8-wo": ("torchqkit::linear_fp8wo", lambda q, n: (q.qdata, q.scale)),
    "mxfp4": ("torchqkit::linear_mxwo", lambda q, n: (q.qdata, q.scale)),
}
GPU_SHAPES, GPU_MS = [(4096, 4096), (8192, 28672)], [1, 16, 256]
DRY_RUN_SHAPES, DRY_RUN_MS = [(256, 192)], [1, 3]


def default_shapes(dry_run: bool):
    """(shapes, Ms, --quick shapes, --quick Ms) of the GPU table; a dry run takes what the interpreter runs in seconds."""
    if dry_run:
        return DRY_RUN_SHAPES, DRY_RUN_MS, DRY_RUN_SHAPES, DRY_RUN_MS
    return GPU_SHAPES, GPU_MS, [(4096, 4096)], [1, 256]


def require_gpu(dry_run: bool = False) -> str:
    """The device the table runs on: cuda, or cpu under the Triton interpreter for a dry run."""
    if dry_run:
        if torch.cuda.is_available():
            print("benchmarks kernels --dry-run: this machine has a GPU; run without --dry-run", file=sys.stderr)
            raise SystemExit(2)
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("benchmarks kernels --dry-run: set TRITON_INTERPRET=1 (the Triton kernels run interpreted on CPU)",
                  file=sys.stderr)
            raise SystemExit(2)
        return "cpu"
    if not torch.cuda.is_available():
        print(f"benchmarks kernels --device cuda: no CUDA device (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}); "
              "refusing to report CPU timings as GPU figures. Run it on a GPU machine, or drop --device for the CPU "
              "group.", file=sys.stderr)
        raise SystemExit(2)
    return "cuda"


def peak_gbs(override: float | None) -> float:
    if override:
        return override
    p = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else float("nan")  # DDR: x2


def time_ms(fn, *, flush: bool, reps: int, device: str = "cuda") -> float:
    if device != "cuda":  # a dry run: the wall clock, figures nobody keeps
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    scratch = torch.empty(64 * 2**20, dtype=torch.int8, device="cuda") if flush else None  # > any L2
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if scratch is not None:
            scratch.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tinygemm_pack(w, group):
    """torch's own int4 packing (ISA-dependent bytes: never saved) and its scales and zeros."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    sz = torch.stack([scale, zero], -1).reshape(n, k // group, 2).transpose(0, 1).contiguous().bfloat16()
    return packed, sz


def _torchao_int4_ms(w, x, opts):
    import torchao
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    torchao.quantization.quantize_(lin, torchao.quantization.Int4WeightOnlyConfig(group_size=128))
    return time_ms(lambda: lin(x), **opts)


def cells(k, n, m, reps, device="cuda"):
    """[(case, config, ms, weight bytes)] of one (K, N, M)."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    opts = dict(flush=m <= 16, reps=reps, device=device)
    out = [("F.linear, bf16 x", "bfloat16", time_ms(lambda: F.linear(x, w), **opts), n * k * 2)]
    if device == "cuda":  # torch's tinygemm op is CUDA-only (its CPU twin is another op, in the CPU table)
        packed, sz = tinygemm_pack(w, 128)
        out.append(("torch._weight_int4pack_mm", "int4-wo-g128",
                    time_ms(lambda: torch._weight_int4pack_mm(x, packed, 128, sz), **opts), n * k // 2))
    for name, (op, op_args) in OPS.items():
        q = preset_weight(name, w)
        for pref in (KernelPreference.CUDA, KernelPreference.TRITON):
            try:
                fn = kernels.linear_op(op, device, pref)
            except RuntimeError:
                continue  # that backend has no kernel for the op (kernels.status() above says why)
            a = op_args(q, n)
            out.append((f"torchqkit {pref.value}", name, time_ms(lambda: fn(x, *a), **opts), stored_bytes(q)))
    if device == "cuda" and importlib.util.find_spec("torchao") is not None:
        out.append(("torchao Int4WeightOnlyConfig", "int4-wo-g128", _torchao_int4_ms(w, x, opts), n * k // 2))
    return out


def main(args, rec) -> int:
    device = require_gpu(args.dry_run)
    if device == "cuda":
        rec.read_bw_gbs = peak_gbs(args.peak_gbs)
        print(f"GPU: {torch.cuda.get_device_name(0)}, peak DRAM {rec.read_bw_gbs:.0f} GB/s")
    else:
        rec.read_bw_gbs = float("nan")
        print("DRY RUN: the GPU table's code on CPU tensors, Triton interpreted; these are not GPU figures")
    for row in kernels.backend_status(devices=("cuda",)):
        print(f"  {row['linear']}: {row['path']} ({row['why']})")
    for k, n in args.shapes:
        for m in args.ms:
            shape = {"K": k, "N": n, "M": m, "device": device}
            for case, config, ms, nbytes in cells(k, n, m, args.reps, device):
                case = case if device == "cuda" else f"dry run (cpu, interpreted): {case}"
                rec.add(case, config, shape, "time", ms, "ms")
                if device == "cuda":
                    rec.add(case, config, shape, "weight read", nbytes / ms / 1e6, "GB/s")
                    rec.add(case, config, shape, "of peak bandwidth", 100 * nbytes / ms / 1e6 / rec.read_bw_gbs, "%")
    rec.print_table()
    return 0
