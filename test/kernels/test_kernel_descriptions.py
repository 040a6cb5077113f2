"""What status() says each C++ CPU kernel does comes from the extension (Note [Kernel descriptions] in
csrc/cpu/kernel_descriptions.cpp): every op with a CPU kernel is described at every ISA level, status() shows that
description, and the Python package keeps no copy of the words that could drift from the C++."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchqkit import kernels

from cpu_kernel_testing import ISA_LEVELS

ROOT = Path(__file__).resolve().parents[2]
needs_ext = pytest.mark.skipif(not kernels.CPU_EXTENSION_LOADED, reason=kernels.CPU_EXTENSION_REASON)


def _cpu_ops() -> list[str]:
    return [op for op in kernels.OPS if torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")]


@needs_ext
def test_every_op_with_a_cpu_kernel_is_described_at_every_level():
    described = kernels.cpu_kernel_descriptions()
    assert _cpu_ops(), "the extension registered no CPU kernel"
    assert sorted(described) == sorted(_cpu_ops())
    for op in _cpu_ops():
        levels = described[op]["levels"]
        assert sorted(levels) == sorted(ISA_LEVELS), op
        for isa, level in levels.items():
            assert level["runs"] in ISA_LEVELS and len(level["text"]) > 40, (op, isa, level)


@needs_ext
def test_status_shows_the_extensions_description_of_the_running_level():
    described = kernels.cpu_kernel_descriptions()
    isa = torch.ops.torchqkit_cpu.isa()
    rows = {r["linear"]: r for r in kernels.status() if r["layout"] == "(op)"}
    assert sorted(rows) == sorted(_cpu_ops())
    for op, row in rows.items():
        level = described[op]["levels"][isa]
        assert row["path"] == f"cpp {level['runs']}"
        assert f"; {level['text']}" in row["why"], op


def _python_strings() -> dict[str, list[str]]:
    """Every string constant of the package's Python source (implicit concatenations joined, f-string parts
    included), by file."""
    found = {}
    for path in sorted((ROOT / "torchqkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        found[str(path.relative_to(ROOT))] = [node.value for node in ast.walk(tree)
                                             if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return found


@needs_ext
def test_the_python_package_holds_no_copy_of_the_descriptions():
    texts = {level["text"] for op in kernels.cpu_kernel_descriptions().values() for level in op["levels"].values()}
    # pieces of 40 characters: a copy split into string literals differently still shares most of them
    pieces = {text[i:i + 40] for text in texts for i in range(0, len(text) - 40, 40)}
    copies = [f"{path}: {piece!r}" for path, strings in _python_strings().items() for piece in pieces
              if any(piece in s for s in strings)]
    assert not copies, "\n".join(copies[:20])


def test_status_works_and_says_why_without_the_extension():
    env = {**os.environ, "TORCHQKIT_DISABLE_CPU_EXTENSION": "1", "PYTHONPATH": str(ROOT)}
    code = ("import torchqkit as qk\n"
            "assert qk.kernels.cpu_kernel_descriptions() == {}\n"
            "rows = [r for r in qk.kernels.status() if r['layout'] == '(op)']\n"
            "assert rows and all(r['path'] == 'reference' for r in rows)\n"
            "print(rows[0]['why'])\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "TORCHQKIT_DISABLE_CPU_EXTENSION=1 skipped the C++ CPU extension" in done.stdout
