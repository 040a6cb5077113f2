"""benchmarks/bench_linear.py: the CPU table still runs (--quick), and --device cuda refuses to print
anything without a GPU instead of passing CPU timings off as GPU figures."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_linear.py"


def _run(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)


def test_cpu_quick_table_runs():
    proc = _run("--quick")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "read bandwidth at the end" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_mode_refuses_without_a_gpu():
    proc = _run("--device", "cuda", "--quick")
    assert proc.returncode != 0
    assert "refusing to report CPU timings as GPU figures" in proc.stderr
    assert "ms" not in proc.stdout  # not one timing printed
