"""python -m benchmarks kernels: the CPU group still runs (--quick), and --device cuda refuses to print anything
without a GPU instead of passing CPU timings off as GPU figures."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "benchmarks", "kernels", "--out", str(tmp_path / "k.jsonl"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_cpu_quick_table_runs(tmp_path):
    proc = _run(tmp_path, "--quick")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "read bandwidth at the end" in proc.stdout
    assert (tmp_path / "k.jsonl").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_mode_refuses_without_a_gpu(tmp_path):
    proc = _run(tmp_path, "--device", "cuda", "--quick")
    assert proc.returncode != 0
    assert "refusing to report CPU timings as GPU figures" in proc.stderr
    assert "ms" not in proc.stdout  # not one timing printed
    assert not (tmp_path / "k.jsonl").exists()
