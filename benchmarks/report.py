"""python -m benchmarks report [--results DIR] [--groups kernels,decode,...]: markdown tables of the latest run per
case (common/latest.py) of each group's JSON lines, one table per group, with the machine, commit and command lines of
the runs they come from: what a docs page pastes."""
from __future__ import annotations

import argparse
import sys

from .common.latest import load_dir
from .common.records import RESULTS, parts, shape_text


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(records: list[dict]) -> str:
    """Rows (ISA level, case, config, shape), one column per metric (unit in brackets). The level is the one the
    C++ kernels ran at: the CPU's best, or the one TORCHQKIT_CPU_ISA forced."""
    columns, rows = [], {}
    for r in records:
        col = f"{r['metric']} [{r['unit']}]" if r["unit"] else r["metric"]
        if col not in columns:
            columns.append(col)
        level = (r.get("machine") or {}).get("isa") or "-"
        rows.setdefault((level, r["case"], r["config"], shape_text(r["shape"])), {})[col] = _cell(r["value"])
    lines = ["| level | case | config | shape | " + " | ".join(columns) + " |",
             "|---|---|---|---|" + "---:|" * len(columns)]
    lines += [f"| {level} | {case} | {config} | {shape} | " + " | ".join(cells.get(c, "") for c in columns) + " |"
              for (level, case, config, shape), cells in rows.items()]
    return "\n".join(lines)


def provenance(records: list[dict]) -> str:
    """Where the table's figures come from: each distinct run (date, commit, machine, command)."""
    runs = {(r["date"], r["git_commit"], r["machine"]["cpu"], r["machine"]["threads"], r["command"]) for r in records}
    return "\n".join(f"- {date} UTC, commit {commit[:12]}, {cpu}, {threads} threads: `{command}`"
                     for date, commit, cpu, threads, command in sorted(runs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__)
    p.add_argument("--results", default=str(RESULTS), help="folder of <group>.jsonl files (default %(default)s)")
    p.add_argument("--groups", default=None, help="comma-separated groups (default: every file in --results)")
    args = p.parse_args(argv)
    groups = load_dir(args.results)
    wanted = args.groups.split(",") if args.groups else list(groups)
    missing = [g for g in wanted if g not in groups]
    if missing or not groups:
        print(f"python -m benchmarks report: no results for {missing or 'any group'} in {args.results}",
              file=sys.stderr)
        return 2
    for group in wanted:
        records = groups[group]
        bw = sorted({r["read_bw_gbs"] for r in records if r.get("read_bw_gbs")})
        print(f"### {group}\n")
        for part in parts(records):
            print(markdown(part) + "\n")
        if bw:
            print(f"Read bandwidth measured by the runs: {', '.join(f'{b:.1f}' for b in bw)} GB/s.\n")
        print(provenance(records) + "\n")
    return 0
