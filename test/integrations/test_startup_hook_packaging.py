"""Wheels and editable installs ship the interpreter-start hook: torchqkit-startup.pth (the line
_torchqkit_startup.PTH_LINE) at the wheel's root, which pip installs into site-packages, and _torchqkit_startup.py
(Note [Registering with transformers at interpreter start]). Both are built from a copy of the tree, without the
C++ extension."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import _torchqkit_startup

ROOT = Path(__file__).resolve().parents[2]


def _copy_tree(tmp_path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "torchqkit", src / "torchqkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_C_cpu.*"))
    for name in ("setup.py", "pyproject.toml", "README.md", "_torchqkit_startup.py"):
        shutil.copy2(ROOT / name, src / name)
    return src


ENV = {**os.environ, "TORCHQKIT_BUILD_CPU": "0", "TORCHQKIT_BUILD_CUDA": "0"}


def _check_pth(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        assert z.read(_torchqkit_startup.PTH_NAME).decode() == _torchqkit_startup.PTH_LINE
        return z.namelist()


def test_wheel_ships_the_hook(tmp_path):
    src = _copy_tree(tmp_path)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("torchqkit-*.whl")
    names = _check_pth(wheel)
    assert "_torchqkit_startup.py" in names and "torchqkit/__init__.py" in names


def test_editable_wheel_ships_the_pth(tmp_path):
    """What `pip install -e` installs: the PEP 660 editable wheel setuptools builds (the modules stay in the tree)."""
    src = _copy_tree(tmp_path)
    code = f"import setuptools.build_meta as b; print(b.build_editable({str(tmp_path / 'dist')!r}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    _check_pth(tmp_path / "dist" / run.stdout.split()[-1])
