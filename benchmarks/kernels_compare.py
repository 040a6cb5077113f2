"""kernels --compare OLD_TREE: before / after in one run. The kernels group runs with --cpu-time --threads 1 (this
thread's CPU time per call: a loaded shared host's queue does not inflate it) on OLD_TREE's torchqkit (a copy of the
repository with its built extension) and on this one in turn, --rounds times, alternating which goes first; each
cell's records give the median over rounds before and after and the speed-up, with the read bandwidth of this run."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common.latest import key
from .common.machine import REPO
from .common.records import read_records


def _child_argv(args, out: Path) -> list[str]:
    argv = ["--cpu-time", "--threads", "1", "--out", str(out), "--configs", ",".join(args.configs), "--reps",
            str(args.reps), "--budget", str(args.budget), "--stat", args.stat,
            "--shapes", ",".join(f"{k}:{n}" for k, n in args.shapes), "--ms", ",".join(map(str, args.ms))]
    return argv + (["--hot"] if args.hot else []) + (["--quick"] if args.quick else [])


def _run(tree: Path, args, out: Path) -> dict[tuple, dict]:
    """{record key: time record} of one kernels run on `tree`'s torchqkit (and its benchmarks package, or this
    checkout's where the tree has none)."""
    # PYTHONSAFEPATH: `-m` would put the working directory (this checkout) ahead of PYTHONPATH, so both runs would
    # import this checkout's torchqkit.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)]), "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "kernels", *_child_argv(args, out)], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"kernels on {tree} failed:\n{proc.stderr[-2000:]}")
    return {key(r): r for r in read_records(out) if r["metric"] == "time" and r["value"]}


def main(args, rec) -> int:
    trees = {"before": Path(args.compare).resolve(), "after": REPO}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                runs[label].append(_run(trees[label], args, Path(d) / f"{label}{r}.jsonl"))
    cells = [k for k in runs["after"][0] if all(k in run for run in runs["before"] + runs["after"])]
    for k in cells:
        before = statistics.median(run[k]["value"] for run in runs["before"])
        after = statistics.median(run[k]["value"] for run in runs["after"])
        case, config, shape = k[0], k[1], runs["after"][0][k]["shape"]
        extra = dict(before_tree=str(trees["before"]), rounds=args.rounds)
        rec.add(case, config, shape, "CPU time before", before, "ms", **extra)
        rec.add(case, config, shape, "CPU time after", after, "ms", **extra)
        rec.add(case, config, shape, "speed-up", before / after, "x", **extra)
    rec.print_table()
    return 0
