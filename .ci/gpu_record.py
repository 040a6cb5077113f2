"""Record a `.ci/gpu_check.sh` run from its output folder: `python .ci/gpu_record.py OUTDIR`.

Adds the run's row to the table in docs/reference/gpu-runs.md (what has run on which GPU) and appends its benchmark
JSON lines (OUTDIR/gpu-kernels.jsonl) to benchmarks/results/kernels.jsonl, where `python -m benchmarks report` reads
them. A dry run is refused: it ran on a CPU, and the page lists GPU runs only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reference" / "gpu-runs.md"
RESULTS = ROOT / "benchmarks" / "results" / "kernels.jsonl"
TABLE_END = "<!-- gpu runs: end of table (.ci/gpu_record.py inserts rows above) -->"
NO_RUN_YET = "| - | no GPU run yet | | | | | |"


def row(run: dict) -> str:
    tests = run.get("tests") or {}
    counts = (f"{tests.get('passed', '?')} passed, {tests.get('failed', '?')} failed, {tests.get('skipped', '?')} "
              f"skipped of {tests.get('marked', '?')}") if tests else "did not run"
    steps = ", ".join(f"{name}: {result}" for name, result in run["steps"].items())
    return (f"| {run['date'][:10]} | {run['machine']} | {run['torch']} | `{run['commit']}` | {counts} | {steps} | "
            f"{run['seconds']} |")


def record(outdir: Path, doc: Path = DOC, results: Path = RESULTS) -> str:
    run = json.loads((outdir / "run.json").read_text())
    if run["dry_run"]:
        raise SystemExit(f"gpu_record: {outdir} holds a dry run (CPU): only GPU runs are recorded")
    text = doc.read_text()
    if TABLE_END not in text:
        raise SystemExit(f"gpu_record: {doc} has lost its end-of-table marker {TABLE_END!r}")
    line = row(run)
    text = text.replace(NO_RUN_YET + "\n", "").replace(TABLE_END, line + "\n" + TABLE_END)
    doc.write_text(text)
    bench = outdir / "gpu-kernels.jsonl"
    if bench.is_file():
        results.parent.mkdir(parents=True, exist_ok=True)
        with results.open("a") as f:
            f.write(bench.read_text())
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python .ci/gpu_record.py", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path, help="the folder .ci/gpu_check.sh wrote ($OUT on the GPU machine)")
    args = p.parse_args(argv)
    print(f"gpu_record: added to {DOC.relative_to(ROOT)}:\n{record(args.outdir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
