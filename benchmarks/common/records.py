"""One JSON line per measurement, appended to benchmarks/results/<group>.jsonl (or --out), and the readable table
of a run's records on stdout.

A record: group, case (what was timed or scored), config (a torchqkit preset name, `<preset>+<change>`, or the float
baseline float32 / bfloat16), shape (dict), metric, value, unit; then the run's context, the same for every record of
the run: machine, versions, git commit, UTC date, the command line, and `read_bw_gbs`, the read bandwidth measured
by this run, in groups whose figures are memory-bound. `extra` holds what a case adds (a note, a goal)."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shlex
import sys
from pathlib import Path

from . import machine

RESULTS = Path(__file__).resolve().parents[1] / "results"
FIELDS = ("group", "case", "config", "shape", "metric", "value", "unit", "machine", "git_commit", "torchqkit_version",
          "torch_version", "date", "command", "read_bw_gbs")


def default_out(group: str) -> Path:
    return RESULTS / f"{group}.jsonl"


def shape_text(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


# Environment variables that change which code a run measures: the command line a record keeps names them.
SETTINGS = ("TORCHQKIT_CPU_ISA", "TORCHQKIT_CPU_AVX_VNNI", "TORCHQKIT_CPU_FP32_PREFILL", "ATEN_CPU_CAPABILITY",
            "ONEDNN_MAX_CPU_ISA")


class Recorder:
    """Collects and appends one group run's records; read_bw_gbs, once set, goes into every later record."""

    def __init__(self, group: str, out: Path | str | None, argv: list[str] | None = None):
        self.group = group
        self.out = Path(out) if out else default_out(group)
        settings = [f"{name}={os.environ[name]}" for name in SETTINGS if os.environ.get(name)]
        self.command = shlex.join([*settings, Path(sys.executable).name, "-m", "benchmarks", group,
                                   *(sys.argv[2:] if argv is None else argv)])
        self.date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.read_bw_gbs: float | None = None
        self.records: list[dict] = []

    def add(self, case: str, config: str, shape: dict, metric: str, value: float, unit: str, **extra) -> dict:
        record = {"group": self.group, "case": case, "config": config, "shape": shape, "metric": metric,
                  "value": None if value is None or (isinstance(value, float) and math.isnan(value)) else value,
                  "unit": unit, "machine": machine.describe(), **machine.versions(), "date": self.date,
                  "command": self.command, "read_bw_gbs": self.read_bw_gbs}
        if extra:
            record["extra"] = extra
        self.records.append(record)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.out, "a") as f:  # as it goes: a run that fails half-way keeps what it measured
            f.write(json.dumps(record) + "\n")
        return record

    def print_table(self, file=sys.stdout) -> None:
        print(format_table(self.records), file=file)
        print(f"{len(self.records)} records appended to {self.out}", file=file)


def _cell(value, unit: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def parts(records: list[dict]) -> list[list[dict]]:
    """The records split by the keys of their shapes, in order of first appearance: a group's parts (an LLM's rows,
    a synthetic decoder's, MiniLM's) measure different things; one table of all their metrics would be mostly blank."""
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault(tuple(r["shape"]), []).append(r)
    return list(out.values())


def format_table(records: list[dict]) -> str:
    """One table per part (see parts)."""
    return "\n\n".join(_table(part) for part in parts(records))


def _table(records: list[dict]) -> str:
    """Rows (case, config, shape), one column per metric (with its unit)."""
    columns: list[tuple[str, str]] = []
    rows: dict[tuple, dict] = {}
    for r in records:
        col = (r["metric"], r["unit"])
        if col not in columns:
            columns.append(col)
        rows.setdefault((r["case"], r["config"], shape_text(r["shape"])), {})[col] = _cell(r["value"], r["unit"])
    head = ["case", "config", "shape"] + [f"{m} [{u}]" if u else m for m, u in columns]
    lines = [head] + [[*key, *(cells.get(c, "") for c in columns)] for key, cells in rows.items()]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def read_records(path: Path | str) -> list[dict]:
    """The records of a JSON-lines file (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
