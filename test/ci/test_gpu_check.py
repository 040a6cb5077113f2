"""`.ci/gpu_check.sh`, the command that turns a lent GPU's minutes into a full check (docs/reference/gpu-runs.md),
exercised here without a GPU: its one-line exit, its --dry-run (every step on CPU: the gpu tests collected and
skipped, the benchmark's code interpreted), its output folder (at most 8 files come back from the GPU machine), and
`.ci/gpu_record.py`, which writes a GPU run into the docs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the command on a machine without a GPU")


def _run(*args, env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**env, "PYTHON": sys.executable})


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    proc = _run(str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("gpu_check: no CUDA GPU here (torch ")
    assert not (tmp_path / "out").exists()  # nothing written where nothing was checked


def test_unknown_option_is_refused():
    proc = _run("--fast")
    assert proc.returncode == 2 and "unknown option --fast" in proc.stderr


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run("--dry-run", str(out))
    return proc, out


def test_dry_run_runs_every_step_and_passes(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"gpu_check: torch {torch.__version__}") and "needs torch >= 2.11" in first
    summary = (out / "summary.md").read_text()
    for step in ("build", "tests", "bench"):
        assert f"| {step} | ok |" in summary, summary
    assert "every step passed" in summary


def test_dry_run_collects_every_gpu_test_and_skips_each_with_its_reason(dry_run):
    proc, out = dry_run
    run = json.loads((out / "run.json").read_text())
    assert run["dry_run"] is True and run["steps"] == {"build": "ok", "tests": "ok", "bench": "ok"}
    tests = run["tests"]
    assert tests["run"] == tests["marked"] == tests["skipped"] > 400 and tests["failed"] == tests["passed"] == 0
    log = (out / "tests.log").read_text()
    assert "needs a CUDA GPU" in log and "=== group cuda-int4" in log and "=== group end-to-end" in log


def test_dry_run_benchmark_rows_are_marked_and_carry_no_bandwidth(dry_run):
    _, out = dry_run
    records = [json.loads(line) for line in (out / "gpu-kernels.jsonl").read_text().splitlines()]
    assert records and all(r["case"].startswith("dry run (cpu, interpreted): ") for r in records)
    assert {r["metric"] for r in records} == {"time"}
    assert {r["config"] for r in records} >= {"bfloat16", "int4-wo-g128", "int8-wo", "nf4-b64", "fp8-wo", "mxfp4"}


def test_output_fits_what_the_gpu_machine_sends_back(dry_run):
    _, out = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.log", "build.log", "gpu-kernels.jsonl", "gpu-tests.xml", "run.json", "summary.md",
                     "tests.log"]
    assert len(files) <= 8 and all((out / f).stat().st_size < 16 * 2**20 for f in files)


def test_record_refuses_a_dry_run_and_writes_a_gpu_run_into_the_docs(dry_run, tmp_path):
    _, out = dry_run
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import gpu_record
    finally:
        sys.path.pop(0)
    doc, results = tmp_path / "gpu-runs.md", tmp_path / "kernels.jsonl"
    shutil.copy(gpu_record.DOC, doc)
    with pytest.raises(SystemExit, match="dry run"):
        gpu_record.record(out, doc, results)
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    run = json.loads((out / "run.json").read_text())
    run.update(dry_run=False, machine="NVIDIA H200 (sm_90)", tests=dict(run["tests"], passed=521, skipped=0))
    (gpu / "run.json").write_text(json.dumps(run))
    (gpu / "gpu-kernels.jsonl").write_text('{"case": "x"}\n')
    line = gpu_record.record(gpu, doc, results)
    text = doc.read_text()
    assert line in text and gpu_record.NO_RUN_YET not in text
    assert text.index(line) < text.index(gpu_record.TABLE_END)
    assert "| NVIDIA H200 (sm_90) |" in line and "521 passed, 0 failed, 0 skipped" in line
    assert results.read_text() == '{"case": "x"}\n'
