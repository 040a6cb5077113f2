"""The CPU kernel targets, measured and checked at every ISA level this CPU runs, one process per level.

    python -m benchmarks targets                          # the best level (and avx512_bf16 below amx), AVX-VNNI, AVX2
    python -m benchmarks targets --levels avx2 --quick    # one level, 512 x 512 (seconds; a smoke run)

Each level runs in its own process with TORCHQKIT_CPU_ISA forcing torchqkit's kernels, and ATEN_CPU_CAPABILITY /
ONEDNN_MAX_CPU_ISA forcing torch's own (the fp32 F.linear baseline and torch's int4 op) to the same level, so a ratio
compares like with like. Cells are 4096 x 4096 (K x N), timed as the kernels group times them (median call; M = 1
calls read their weight from a ring of copies > 3x L3). Each M = 1 cell's read bandwidth (its records' read_bw_gbs) is
the mean of two probes taken right before and right after it: on a shared host the probe moves by 20-40% within a
minute, and one reference per level made the shares move with it. Each M = 1 cell also records the same call with the
weight cached ('cached'): what the instructions reach when memory is not the limit; a cell below its goal even cached
is bound by the cores at this bandwidth, not by the memory side.

Targets:
- M = 1, every weight-only format, float32 and bf16 activations: >= 80% of the read bandwidth with AVX-512, >= 70%
  below (bytes = the weight's stored codes + scales).
- int4-wo-g128 at M = 1: >= 1.3x torch's _weight_int4pack_mm_for_cpu (bf16 activations both).
- int8 dynamic activations x int4 / int8 weights at M = 1: >= 90% of the read bandwidth.
- M = 256, every weight-only format, float32 activations: >= 1.5x fp32 F.linear with AVX-512, >= 1.0x below (bf16
  activations recorded, not checked).
- int8 dynamic x int8 / int4 at M = 256: >= 7x fp32 F.linear with VNNI (AVX-512 or AVX-VNNI), >= 2.5x on AVX2.
- The 4-bit / float8 / MX / NVFP4 activation configs (W4A4, float8 x int4, MXFP8 x MXFP4, NVFP4 x NVFP4, float8 x
  float8): the weight bytes at M = 1 as the weight-only formats, and M = 256 as them (they run the integer kernel with
  int4 codes, or the weight-only kernels on the fake-quantized input).
- ternary (bit planes, table lookups) at M = 1: >= 1.5x the packed int2 kernel (the same group scales).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from .common import cli, machine
from .common.memory import QUICK_BYTES, QUICK_RING, RING_BYTES, read_bandwidth
from .common.timing import Timer
from .common.weights import direct_call, preset_weight, stored_bytes
from .kernels import torch_int4_pack

GROUP = "targets"
# torch's own ops at the level torchqkit is forced to (the baselines must not run AVX-512 under an AVX2 kernel)
LEVEL_ENV = {
    "amx": {"ATEN_CPU_CAPABILITY": "avx512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512_vnni": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx_vnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
WEIGHT_ONLY = ("int8-wo", "int4-wo-g128", "nf4-b64", "fp8-wo", "mxfp4", "mxfp8", "intx4-wo-sym-g32+bits3", "nvfp4",
               "fp6-e2m3", "fp6-e3m2")
DYNAMIC = ("int8-dyn-int8", "int8-dyn-int4-g32+g128")
LOW_BIT_ACTIVATIONS = ("int4-dyn-int4-g32", "fp8-dyn-int4-g32", "mxfp8-dyn-mxfp4", "nvfp4-dyn-nvfp4", "fp8-dyn-row")
TERNARY, INT2 = "ternary-g32", "intx4-wo-sym-g32+bits2"  # both int2 codes with an absmax-style scale per 32
QUICK = ("int8-wo", "int4-wo-g128", "nf4-b64", "int8-dyn-int8")  # --quick: each kind of cell once


def is_avx512(level: str) -> bool:
    return level.startswith("avx512") or level == "amx"


def has_vnni(level: str) -> bool:
    return level in ("amx", "avx512_bf16", "avx512_vnni", "avx_vnni")


def levels_this_cpu_runs() -> list[str]:
    """The best level, AVX512-BF16 when the best is AMX, AVX-VNNI when the CPU has it, and AVX2 (each asked of the
    extension in a child process: it refuses a level the CPU lacks)."""
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


def _row(target, config, m, value, unit, goal, **extra) -> dict:
    return dict(target=target, config=config, M=m, value=value, unit=unit, goal=goal, **extra)


def measure(level: str, k: int, n: int, timer: Timer, probe_bytes: int,
            names=WEIGHT_ONLY + DYNAMIC + LOW_BIT_ACTIVATIONS) -> list[dict]:
    """This process's rows (it runs at `level`): one dict per target cell."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    weights = {name: preset_weight(name, w) for name in names}
    bw_goal = 0.8 if is_avx512(level) else 0.7
    probe = lambda: read_bandwidth(reps=7 if probe_bytes >= RING_BYTES else 2, nbytes=probe_bytes)  # noqa: E731
    rows = []
    for m in (1, 256):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
        xb = x.bfloat16()
        acts = {"f32": x, "bf16": xb}
        if m == 1:
            for name, q in weights.items():
                if name in (TERNARY, INT2):
                    continue  # their target is the ratio below
                nbytes = stored_bytes(q)
                for act, xa in acts.items():
                    if name in DYNAMIC and act == "bf16":
                        continue
                    fn, op = direct_call(q, xa)
                    before = probe()
                    t = timer(fn, q, cold=True)
                    bw = (before + probe()) / 2
                    cached = timer(fn, q, cold=False)
                    goal = 0.9 if name in DYNAMIC else bw_goal
                    rows.append(_row(f"M=1 {act} x: share of read bandwidth", name, m, 100 * nbytes / t / 1e9 / bw, "%",
                                     100 * goal, read_bw_gbs=bw, cached_gbs=nbytes / cached / 1e9, op=op))
            if TERNARY in names:
                times, ops = {}, {}
                for name in (INT2, TERNARY):
                    fn, ops[name] = direct_call(weights[name], x)
                    times[name] = timer(fn, weights[name], cold=True)
                rows.append(_row("M=1 f32 x: x the packed int2 kernel", TERNARY, m, times[INT2] / times[TERNARY], "x",
                                 1.5, op=ops[TERNARY]))
            q = weights["int4-wo-g128"]
            packed, sz = torch_int4_pack(q, k, n, 128)
            fn, _ = direct_call(q, xb)
            ours = timer(fn, q, cold=True)
            before = probe()
            theirs = timer(lambda pk: torch._weight_int4pack_mm_for_cpu(xb, pk, 128, sz), packed, cold=True)
            bw = (before + probe()) / 2
            torch_share = (stored_bytes(packed) + stored_bytes(sz)) / theirs / 1e9 / bw
            rows.append(_row("M=1 bf16 x: x torch._weight_int4pack_mm_for_cpu", "int4-wo-g128", m, theirs / ours, "x",
                             1.3, read_bw_gbs=bw, torch_share_pct=100 * torch_share))
        else:
            t32 = timer(lambda w: F.linear(x, w), w)
            for name, q in weights.items():
                for act, xa in acts.items():
                    if name in DYNAMIC and act == "bf16":
                        continue
                    fn, op = direct_call(q, xa)
                    t = timer(fn, q)
                    if name in (TERNARY, INT2):
                        continue  # their target is the decode ratio
                    if name in DYNAMIC:
                        goal = 7.0 if has_vnni(level) else 2.5
                    else:
                        goal = (1.5 if is_avx512(level) else 1.0) if act == "f32" else None
                    rows.append(_row(f"M=256 {act} x: x fp32 F.linear", name, m, t32 / t, "x", goal, op=op))
    return [dict(r, level=level) for r in rows]


def record(rows: list[dict], k: int, n: int, rec) -> tuple[int, int]:
    """Appends a level's rows; (met, checked)."""
    met = checked = 0
    probes: dict[str, list[float]] = {}
    for r in rows:
        if "read_bw_gbs" in r:
            probes.setdefault(r["level"], []).append(r["read_bw_gbs"])
    level_bw = {level: sum(v) / len(v) for level, v in probes.items()}
    for r in rows:
        extra = {key: r[key] for key in ("goal", "cached_gbs", "torch_share_pct", "op") if r.get(key) is not None}
        if r["goal"] is not None:
            checked += 1
            met += r["value"] >= r["goal"]
            extra["met"] = r["value"] >= r["goal"]
            if "cached_gbs" in r:  # below the goal even with the weight in cache: bound by the cores, not memory
                extra["met_cached"] = 100 * r["cached_gbs"] / r["read_bw_gbs"] >= r["goal"]
        # an M = 1 cell's own probes; an M = 256 ratio (compute-bound) carries the mean of its level's probes
        rec.read_bw_gbs = r.get("read_bw_gbs", level_bw[r["level"]])
        rec.add(r["target"], r["config"], {"K": k, "N": n, "M": r["M"], "isa": r["level"]}, "measured", r["value"],
                r["unit"], **extra)
    return met, checked


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    p.add_argument("--levels", default=None, help="comma-separated ISA levels (default: the levels this CPU runs, "
                                                  f"of {', '.join(LEVEL_ENV)}; --quick: the one it runs by default)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one level, in this process: JSON rows
    args, rec = cli.start(GROUP, p, argv)
    k = n = 512 if args.quick else 4096
    timer = Timer(*((2, 0.0) if args.quick else (5, 1.0)), ring_bytes=QUICK_RING if args.quick else RING_BYTES)
    probe_bytes = QUICK_BYTES if args.quick else RING_BYTES
    if args.child:
        got = machine.isa_level()
        if got != args.child:
            raise SystemExit(f"asked for ISA level {args.child}, the extension runs {got}")
        names = QUICK if args.quick else WEIGHT_ONLY + DYNAMIC + LOW_BIT_ACTIVATIONS + (TERNARY, INT2)
        print(json.dumps(measure(args.child, k, n, timer, probe_bytes, names)))
        return 0
    levels = (args.levels.split(",") if args.levels else [machine.isa_level()] if args.quick else
              levels_this_cpu_runs())
    unknown = sorted(set(levels) - set(LEVEL_ENV))
    if unknown:
        p.error(f"--levels: unknown {unknown}; known: {', '.join(LEVEL_ENV)}")
    met = checked = 0
    for level in levels:
        env = dict(os.environ, TORCHQKIT_CPU_ISA=level, **LEVEL_ENV[level])
        cmd = [sys.executable, "-m", "benchmarks", GROUP, "--child", level, "--threads", str(torch.get_num_threads())]
        out = subprocess.run(cmd + (["--quick"] if args.quick else []), env=env, capture_output=True, text=True,
                             cwd=machine.REPO)
        if out.returncode != 0:
            raise SystemExit(f"level {level}: the measuring process failed:\n{out.stderr[-2000:]}")
        a, b = record(json.loads(out.stdout.strip().splitlines()[-1]), k, n, rec)
        met, checked = met + a, checked + b
    rec.print_table()
    print(f"targets met: {met} of {checked} (each record's extra.met; extra.met_cached false: below the goal even "
          "with the weight in cache)")
    return 0

