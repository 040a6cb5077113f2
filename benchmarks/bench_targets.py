"""The CPU kernel targets, measured and checked at every ISA level this CPU runs, one table per level.

    python benchmarks/bench_targets.py                       # the best level (and avx512_bf16 below amx), AVX-VNNI, AVX2
    python benchmarks/bench_targets.py --levels avx2 --quick # one level, 1024 x 1024 (seconds; a smoke run)

Each level runs in its own process with TORCHQKIT_CPU_ISA forcing torchqkit's kernels, and ATEN_CPU_CAPABILITY /
ONEDNN_MAX_CPU_ISA forcing torch's own (the fp32 F.linear baseline and torch's int4 op) to the same level, so a
ratio compares like with like. Cells are 4096 x 4096 (K x N), 2 threads, timed as bench_linear.py times them
(median call; M = 1 calls read their weight from a ring of copies > 3x L3, i.e. from memory). Each M = 1 cell's
read bandwidth is the mean of two probes taken by the same process right before and right after it: on a shared
host the probe moves by 20-40% within a minute, and a reference taken once per level made the M = 1 shares move
with it (three runs of the whole table met 28, 11 and 17 targets).

Each M = 1 row also gives the same call's speed with the weight cached (one copy, reused: it stays in L2 / L3),
as GB/s and as a share of the read bandwidth (the 'cached GB/s' column): what the kernel's instructions reach on these cores
when memory is not the limit. A row whose cached share is below its goal ('not even cached') is bound by the cores
(their instructions, or L2 / L3 for the int8 / float8 weights of 16 MiB) at this bandwidth, not by the memory
side: no prefetch or layout change can meet it on this host.

Targets:
- M = 1, every weight-only format, float32 and bf16 activations: >= 80% of the read bandwidth with AVX-512,
  >= 70% below (bytes = the weight's stored codes + scales).
- int4 g128 at M = 1: >= 1.3x the speed of torch's _weight_int4pack_mm_for_cpu (bf16 activations both). The row
  also gives torch's op's own share of the read bandwidth (probes on either side of it) and the ratio ours would
  reach at 100% of it: where torch's op already reads at more than 77%, 1.3x would take more than the memory gives.
- int8-dynamic activations x int4 / int8 weights at M = 1: >= 90% of the read bandwidth.
- M = 256, every weight-only format, float32 activations: >= 1.5x fp32 F.linear with AVX-512, >= 1.0x below
  (the bf16-activation ratio is printed next to it, not checked).
- int8-dynamic x int8 / int4 at M = 256: >= 7x fp32 F.linear with VNNI (AVX-512 or AVX-VNNI), >= 2.5x on AVX2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q

# torch's own ops at the level torchqkit is forced to (the baselines must not run AVX-512 under an AVX2 kernel)
LEVEL_ENV = {
    "amx": {"ATEN_CPU_CAPABILITY": "avx512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512_vnni": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx_vnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
LOWBIT = ("nf4", "fp8", "mxfp4", "mxfp8", "int3")  # bench_lowbit.py's FORMATS (nf4 b64, e4m3 per row, MX per 32, int3 g32)
ROW = "{level:<12} {target:<42} {value:>9}  {goal:>7}  {bw:>8}  {cached:>14}  {verdict}"


def is_avx512(level: str) -> bool:
    return level.startswith("avx512") or level == "amx"


def has_vnni(level: str) -> bool:
    return level in ("amx", "avx512_bf16", "avx512_vnni", "avx_vnni")


def levels_this_cpu_runs() -> list[str]:
    """The best level, AVX512-BF16 when the best is AMX (the level of AVX-512 CPUs without AMX), AVX-VNNI when the
    CPU has it, and AVX2 (each asked of the extension in a child process: it refuses a level the CPU lacks)."""
    runs = []
    for level in LEVEL_ENV:
        env = dict(os.environ, TORCHQKIT_CPU_ISA=level)
        probe = subprocess.run([sys.executable, "-c", "import torch, torchqkit; print(torch.ops.torchqkit_cpu.isa())"],
                               env=env, capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == level:
            runs.append(level)
    best = runs[:1]
    below = ("avx512_bf16", "avx_vnni", "avx2") if best == ["amx"] else ("avx_vnni", "avx2")
    return best + [lv for lv in below if lv in runs and lv not in best]


def weight_cells(k: int, n: int):
    """name -> (weight, call(weight, x) -> out) for every weight-only format, on the op each layout routes to (the
    weight is an argument: bench() hands each call the next copy of it from its ring)."""
    from bench_lowbit import FORMATS, call  # sibling files: benchmarks/ is sys.path[0]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    cells = {}
    i8 = qk.quantize_weight(w, Q.int8, qk.PerRow(), qk.PlainLayout(), mapping="symmetric", scale_dtype=torch.float32)
    cells["int8"] = (i8, lambda q, x: torch.ops.torchqkit.linear_int8wo_plain(x, q.qdata, q.scale, None))
    i4 = qk.quantize_weight(w.bfloat16(), Q.uint4, qk.PerGroup(128), qk.TensorCoreTiledLayout(inner_k_tiles=8),
                            mapping="asymmetric", zero_point_domain="float")
    cells["int4 g128"] = (i4, lambda q, x: torch.ops.torchqkit.linear_int4wo_tiled(
        x, q.qdata, q.scale_and_zero, 128, n, None))
    for name in LOWBIT:
        q = FORMATS[name][0](w)
        cells[name] = (q, lambda q, x: call(q, x)())
    return w, i4, cells


def dynamic_cells(w: torch.Tensor):
    """name -> (weight, call(weight, x)) for int8-dynamic activations x int8 / int4 weights."""
    act = qk.ActivationQuantSpec(Q.int8, qk.PerToken(), "asymmetric")
    d8 = qk.quantize_weight(w, Q.int8, qk.PerRow(), qk.PlainLayout(), mapping="symmetric", act_quant=act,
                            scale_dtype=torch.float32)
    d4 = qk.quantize_weight(w, Q.int4, qk.PerGroup(128), qk.PackedIntxLayout(), mapping="symmetric", act_quant=act)
    return {
        "int8-dyn x int8": (d8, lambda q, x: torch.ops.torchqkit.linear_int8da_int8_plain(
            x, q.qdata, q.scale, None, False)),
        "int8-dyn x int4 g128": (d4, lambda q, x: torch.ops.torchqkit.linear_int8da_int4_packed(
            x, q.qdata, q.scale, None, None, False)),
    }


def measure(level: str, k: int, n: int, reps: int, budget: float) -> list[dict]:
    """This process's rows (it runs at `level`): one dict per target cell."""
    from bench_linear import bench, read_bandwidth, torch_int4_pack
    from bench_lowbit import stored_bytes
    w, i4, cells = weight_cells(k, n)
    dyn = dynamic_cells(w)
    rows = []
    bw_goal = 0.8 if is_avx512(level) else 0.7
    for m in (1, 256):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(m, k, generator=g)
        xb = x.bfloat16()
        opts = dict(cold=m == 1, min_reps=reps, budget_s=budget)
        timed, probes = {}, [read_bandwidth() * 1e9] if m == 1 else []
        for name, (q, fn) in {**cells, **dyn}.items():
            timed[name] = (stored_bytes(q), bench(lambda q: fn(q, x), q, **opts),
                           bench(lambda q: fn(q, xb), q, **opts) if name in cells else None)
            if m == 1:  # this cell's reference: the probes on either side of it
                probes.append(read_bandwidth() * 1e9)
                timed[name] += ((probes[-2] + probes[-1]) / 2,)
        # M = 1: name -> (f32 x, bf16 x) seconds with the weight cached, after the cells (the probes stay next to them)
        hot = dict(opts, cold=False)
        cached = {name: (bench(lambda q: fn(q, x), q, **hot),
                         bench(lambda q: fn(q, xb), q, **hot) if name in cells else None)
                  for name, (q, fn) in {**cells, **dyn}.items()} if m == 1 else {}
        if m == 1:
            packed, sz = torch_int4_pack(i4, k, n, 128)
            t_torch = bench(lambda pk: torch._weight_int4pack_mm_for_cpu(xb, pk, 128, sz), packed, **opts)
            probes.append(read_bandwidth() * 1e9)
            torch_bytes = packed.numel() * packed.element_size() + sz.numel() * sz.element_size()
            rows.append(dict(target="int4 g128 M=1 bf16: x torch's int4 op", value=t_torch / timed[
                "int4 g128"][2], goal=1.3, unit="x", torch_share=torch_bytes / t_torch / ((probes[-2] + probes[-1]) / 2)))
        else:
            t32 = bench(lambda w: F.linear(x, w), w, **opts)
        for name, (nbytes, t, tb, *bw) in timed.items():
            if m == 1:
                goal = 0.9 if name in dyn else bw_goal
                rows.append(dict(target=f"{name} M=1 f32: % read bw", value=nbytes / t / bw[0], goal=goal,
                                 unit="%bw", read_bw_gbs=bw[0] / 1e9, cached_gbs=nbytes / cached[name][0] / 1e9))
                if tb is not None:
                    rows.append(dict(target=f"{name} M=1 bf16: % read bw", value=nbytes / tb / bw[0], goal=goal,
                                     unit="%bw", read_bw_gbs=bw[0] / 1e9, cached_gbs=nbytes / cached[name][1] / 1e9))
            elif name in dyn:
                rows.append(dict(target=f"{name} M=256: x fp32 F.linear", value=t32 / t,
                                 goal=7.0 if has_vnni(level) else 2.5, unit="x"))
            else:
                rows.append(dict(target=f"{name} M=256 f32: x fp32 F.linear", value=t32 / t,
                                 goal=1.5 if is_avx512(level) else 1.0, unit="x"))
                rows.append(dict(target=f"{name} M=256 bf16: x fp32 F.linear", value=t32 / tb, goal=None, unit="x"))
    return [dict(r, level=level) for r in rows]


def print_rows(rows: list[dict]) -> tuple[int, int]:
    met = 0
    checked = 0
    for r in rows:
        pct = r["unit"] == "%bw"
        value = f"{r['value']:.1%}" if pct else f"{r['value']:.2f}x"
        goal = "" if r["goal"] is None else (f">={r['goal']:.0%}" if pct else f">={r['goal']:.1f}x")
        verdict = ""
        if r["goal"] is not None:
            checked += 1
            met += r["value"] >= r["goal"]
            verdict = "met" if r["value"] >= r["goal"] else "NOT MET"
        bw = f"{r['read_bw_gbs']:.1f}" if "read_bw_gbs" in r else ""
        cached = ""
        if "cached_gbs" in r:
            share = r["cached_gbs"] / r["read_bw_gbs"]
            cached = f"{r['cached_gbs']:.1f} ({share:.0%})"
            if r["value"] < r["goal"] and share < r["goal"]:
                verdict += ", not even cached"
        if "torch_share" in r:  # the ratio is capped by how close torch's own op already is to the memory's speed
            verdict += (f" (torch's op at {r['torch_share']:.0%} of read bw: {1 / r['torch_share']:.2f}x if ours read "
                        "at 100%)")
        print(ROW.format(level=r["level"], target=r["target"], value=value, goal=goal, bw=bw, cached=cached,
                         verdict=verdict))
    return met, checked


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default=None, help="comma-separated ISA levels (default: the levels this CPU runs, "
                                                  f"of {', '.join(LEVEL_ENV)}; scalar has no speed targets)")
    p.add_argument("--quick", action="store_true", help="1024 x 1024, 2 calls per cell: a smoke run, not the figures")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one level, in this process: JSON rows to stdout
    args = p.parse_args()
    k = n = 1024 if args.quick else 4096
    reps, budget = (2, 0.0) if args.quick else (5, 1.0)
    torch.set_num_threads(args.threads)
    if args.child:
        got = torch.ops.torchqkit_cpu.isa()
        if got != args.child:
            raise SystemExit(f"asked for ISA level {args.child}, the extension runs {got}")
        print(json.dumps(measure(args.child, k, n, reps, budget)))
        return
    from bench_linear import cpu_model
    levels = args.levels.split(",") if args.levels else levels_this_cpu_runs()
    unknown = sorted(set(levels) - set(LEVEL_ENV))
    if unknown:
        p.error(f"--levels: unknown {unknown}; known: {', '.join(LEVEL_ENV)}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, {args.threads} threads, "
          f"{k} x {n}; levels: {', '.join(levels)}")
    print(ROW.format(level="level", target="target", value="measured", goal="goal", bw="read bw",
                     cached="cached GB/s", verdict=""))
    met = checked = 0
    for level in levels:
        env = dict(os.environ, TORCHQKIT_CPU_ISA=level, **LEVEL_ENV[level])
        cmd = [sys.executable, __file__, "--child", level, "--threads", str(args.threads)] + (["--quick"] if args.quick
                                                                                             else [])
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"level {level}: the measuring process failed:\n{out.stderr[-2000:]}")
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        bws = [r["read_bw_gbs"] for r in rows if "read_bw_gbs" in r]
        print(f"-- {level}: read bandwidth {min(bws):.1f}-{max(bws):.1f} GB/s (each M = 1 cell's own, the 'read bw' "
              f"column), {time.perf_counter() - t0:.0f} s")
        a, b = print_rows(rows)
        met, checked = met + a, checked + b
    print(f"targets met: {met} of {checked} ('not even cached': with its weight in cache the call still reads less than "
          "the goal's share of the same read bandwidth)")


if __name__ == "__main__":
    main()
