"""python -m benchmarks plot [--results DIR] [--out DIR]: PNG figures from the groups' JSON lines (the latest run per
case, common/latest.py): kernels.png (time and speed-up over fp32 F.linear by config and M, one row per (K, N)),
decode.png / prefill.png (tokens/s by config and loop, llama.cpp's as a line) and quality.png (perplexity by config
and library, float32's as a line); a group without results gets no figure. Needs matplotlib, which torchqkit itself
never does: pip install 'torchqkit[bench]' (or pip install matplotlib)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common.latest import load_dir
from .common.records import RESULTS

INSTALL = "pip install 'torchqkit[bench]'  (or: pip install matplotlib)"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _select(records, **match):
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def kernels(plt, records, out: Path) -> Path | None:
    ops = [r for r in records if r["case"] == "torchqkit, f32 x" or r["case"] == "F.linear, f32 x"]
    # one row per (shape, ISA level): a run forced to AVX2 is not the native one
    panels = sorted({(r["shape"]["K"], r["shape"]["N"], _level(r)) for r in ops if "K" in r["shape"]})
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4 * len(panels)), squeeze=False)
    for row, (k, n, level) in zip(axes, panels):
        here = [r for r in ops if (r["shape"].get("K"), r["shape"].get("N"), _level(r)) == (k, n, level)]
        for i, config in enumerate(dict.fromkeys(r["config"] for r in here)):
            for ax, metric in zip(row, ("time", "x fp32 F.linear")):
                pts = sorted((r["shape"]["M"], r["value"]) for r in here
                             if r["config"] == config and r["metric"] == metric and r["value"] is not None)
                if pts and not (metric != "time" and config == "float32"):  # fp32 / fp32 = 1: the grey line
                    ax.plot(*zip(*pts), marker="o", label=config, color=f"C{i % 10}",
                            linestyle="--" if config == "float32" else "-")
        where = f"{_cpu(here[0])}, {level}"
        row[0].set(title=f"K={k} N={n}, f32 x: time per call\n{where}", xlabel="M", ylabel="ms", xscale="log",
                   yscale="log")
        row[1].set(title=f"K={k} N={n}: fp32 F.linear time / op time\n{where}", xlabel="M", ylabel="x",
                   xscale="log", yscale="log")
        row[1].axhline(1.0, color="grey", linewidth=0.8)
        row[0].legend(fontsize=7)
        row[1].legend(fontsize=7)
    return _save(plt, fig, out / "kernels.png")


def tokens_per_s(plt, records, out: Path, group: str, metric: str) -> Path | None:
    ours = [r for r in records if r["metric"] == metric and r["config"] != "llama.cpp" and r["value"] is not None]
    if not ours:
        return None
    peer = [r["value"] for r in records if r["metric"] == metric and r["config"] == "llama.cpp"]
    labels = [f"{r['config']}\n{r['case']}" for r in ours]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(ours)), 5))
    ax.bar(range(len(ours)), [r["value"] for r in ours])
    ax.set_xticks(range(len(ours)), labels, rotation=75, fontsize=6)
    if peer:
        ax.axhline(sum(peer) / len(peer), color="red", label="llama.cpp (mean of its runs)")
        ax.legend()
    ax.set(title=f"{group}: {ours[0]['shape'].get('model', '')}\n{_cpu(ours[0])}, {_level(ours[0])}",
           ylabel="tokens/s")
    return _save(plt, fig, out / f"{group}.png")


def quality(plt, records, out: Path) -> Path | None:
    rows = [r for r in records if r["metric"] == "perplexity" and r["value"] is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)), 5))
    ax.bar(range(len(rows)), [r["value"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['config']}\n({r['case']})" for r in rows], rotation=75, fontsize=7)
    base = [r["value"] for r in rows if r["config"] == "float32"]
    if base:
        ax.axhline(base[0], color="red", label="float32")
        ax.set_ylim(bottom=min(r["value"] for r in rows) * 0.98)
        ax.legend()
    ax.set(title=f"quality: perplexity, {rows[0]['shape'].get('model', '')}", ylabel="perplexity")
    return _save(plt, fig, out / "quality.png")


def _level(r: dict) -> str:
    return (r.get("machine") or {}).get("isa") or "?"


def _cpu(r: dict) -> str:
    machine = r.get("machine") or {}
    return f"{machine.get('cpu', '?')}, {machine.get('threads', '?')} threads"


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks plot", description=__doc__)
    p.add_argument("--results", default=str(RESULTS), help="folder of <group>.jsonl files (default %(default)s)")
    p.add_argument("--out", default=None, help="folder for the PNG files (default: --results)")
    args = p.parse_args(argv)
    plt = _pyplot()
    if plt is None:
        print(f"python -m benchmarks plot needs matplotlib, which is not installed: {INSTALL}", file=sys.stderr)
        return 2
    groups = load_dir(args.results)
    out = Path(args.out or args.results)
    out.mkdir(parents=True, exist_ok=True)
    made = [kernels(plt, groups.get("kernels", []), out),
            tokens_per_s(plt, groups.get("decode", []), out, "decode", "decode"),
            tokens_per_s(plt, groups.get("prefill", []), out, "prefill", "prefill"),
            quality(plt, groups.get("quality", []), out)]
    made = [m for m in made if m is not None]
    if not made:
        print(f"python -m benchmarks plot: no kernels / decode / prefill / quality results in {args.results}",
              file=sys.stderr)
        return 2
    for path in made:
        print(path)
    return 0
