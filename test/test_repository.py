"""Repository contracts: the README's set-up commands are what CI runs, and the tutorials run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line.strip() for line in blocks[0].splitlines() if line.strip() and not line.startswith("#")]


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_second():
    demo, tests = _readme_commands()[:2]
    assert demo.startswith("pip install torch==2.13.0") and demo.endswith("python -m torchqkit demo")
    assert tests.startswith("pip install torch==2.13.0") and "[test]" in tests
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, ".ci/run must run exactly the README's test command"


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "tutorials").glob("*.py")))
def test_tutorial_runs(script):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tutorials" / script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
