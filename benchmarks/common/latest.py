"""The latest figure of each case: of the records sharing (case, config, shape, metric, CPU, ISA level), the one of
the latest run (UTC date), so a results file that many runs appended to reads as one current table; runs on another
machine or at a forced ISA level are cases of their own."""
from __future__ import annotations

import json
from pathlib import Path

from .records import read_records


def key(r: dict) -> tuple:
    machine = r.get("machine") or {}
    return (r["case"], r["config"], json.dumps(r["shape"], sort_keys=True), r["metric"], machine.get("cpu"),
            machine.get("isa"))


def latest(records: list[dict]) -> list[dict]:
    """The latest record per key, in the order the keys first appear."""
    best: dict[tuple, dict] = {}
    for r in records:
        k = key(r)
        if k not in best or r["date"] >= best[k]["date"]:
            best[k] = r
    return list(best.values())


def load_dir(results: Path | str) -> dict[str, list[dict]]:
    """group -> the latest records of results/<group>.jsonl, for each file there."""
    return {path.stem: latest(read_records(path)) for path in sorted(Path(results).glob("*.jsonl"))}
