"""GPU half of bench_linear.py (``python benchmarks/bench_linear.py --device cuda``).

Per (K, N, M): median ms of bf16 ``F.linear``, torch's tinygemm ``_weight_int4pack_mm`` (group 128), and
each torchqkit GPU backend of the int4 tiled / NF4 / float8 weight-only ops (C++ CUDA and Triton, where
``torchqkit.kernels`` says they can serve), plus torchao's int4 weight-only linear when torchao is installed.
Timed with CUDA events after warm-up; decode rows (M <= 8) flush L2 first. GB/s counts weight bytes (codes +
scales) and is shown against the GPU's peak DRAM bandwidth (from its memory clock and bus width, or
``--peak-gbs``). Without a CUDA device it refuses to run: CPU timings are never printed as GPU figures.
"""
from __future__ import annotations

import importlib.util
import statistics

import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit import kernels
from torchqkit.tensor.activation import KernelPreference


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"bench_linear --device cuda: no CUDA device (torch {torch.__version__}, CUDA "
                         f"{torch.version.cuda}); refusing to report CPU timings as GPU figures. Run it on a GPU "
                         f"machine, or drop --device for the CPU table.")


def peak_gbs(override: float | None) -> float:
    if override:
        return override
    p = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else float("nan")  # DDR: x2


def time_ms(fn, *, flush: bool, reps: int) -> float:
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


def _quantized(config, w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
    lin.weight.data.copy_(w)
    qk.quantize_(lin, config)
    return lin.weight


def _cells(k, n, m, args):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    opts = dict(flush=m <= 8, reps=args.reps)
    cells = {"bf16": (time_ms(lambda: F.linear(x, w), **opts), n * k * 2)}
    packed, sz = _tinygemm_pack(w, 128)
    cells["tinygemm"] = (time_ms(lambda: torch._weight_int4pack_mm(x, packed, 128, sz), **opts), n * k // 2)
    i4 = _quantized(qk.Int4WeightOnlyConfig(group_size=128), w)
    n4 = _quantized(qk.NF4WeightOnlyConfig(block_size=64), w)
    f8 = _quantized(qk.Float8WeightOnlyConfig(), w)
    ops = {
        "int4": ("torchqkit::linear_int4wo_tiled", (x, i4.qdata, i4.scale_and_zero, 128, n), n * k // 2),
        "nf4": ("torchqkit::linear_nf4wo", (x, n4.qdata, n4.scale, None, None, None, 64), n * k // 2),
        "fp8": ("torchqkit::linear_fp8wo", (x, f8.qdata, f8.scale), n * k),
    }
    for name, (op, op_args, nbytes) in ops.items():
        for pref in (KernelPreference.CUDA, KernelPreference.TRITON):
            try:
                fn = kernels.linear_op(op, "cuda", pref)
            except RuntimeError:
                continue  # that backend has no kernel for the op: the column shows "-"
            cells[f"{name} {pref.value}"] = (time_ms(lambda: fn(*op_args), **opts), nbytes)
    if importlib.util.find_spec("torchao") is not None:
        cells["torchao int4"] = (_torchao_int4_ms(w, x, opts), n * k // 2)
    return cells


def _tinygemm_pack(w, group):
    """torch's own int4 packing (ISA-dependent bytes: never saved; see docs/platform.md) and its scales."""
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


def main_cuda(args, shapes, ms) -> None:
    require_gpu()
    peak = peak_gbs(args.peak_gbs)
    print(f"GPU: {torch.cuda.get_device_name(0)}, peak DRAM {peak:.0f} GB/s, torch {torch.__version__}, "
          f"torchqkit {qk.__version__}")
    for row in kernels.backend_status(devices=("cuda",)):
        print(f"  {row['linear']}: {row['path']} ({row['why']})")
    for k, n in shapes:
        for m in ms:
            cells = _cells(k, n, m, args)
            text = "  ".join(f"{name} {t:.3f} ms {nbytes / t / 1e6:.0f} GB/s ({nbytes / t / 1e6 / peak:.0%})"
                             for name, (t, nbytes) in cells.items())
            print(f"K={k} N={n} M={m}: {text}", flush=True)
