"""Repository contracts: the README's set-up commands are what CI runs, the tutorials run, the packages keep their layers."""
from __future__ import annotations

import ast
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


# Packages from the bottom up (docs/architecture.md): a module imports only from its own package or one of a
# lower rank, and never another package's private (_underscore) names.
_LAYERS = (("files", "version", "progress"), ("core",), ("kernels",), ("layouts",), ("tensor",), ("algorithms",), ("api",),
           ("training", "distributed"), ("serialization",), ("hf",), ("integrations",), ("kvcache",), ("eval",), ("export",),
           ("demo", "cli"), ("__main__", "__init__"))
_RANK = {name: rank for rank, names in enumerate(_LAYERS) for name in names}


def _relative_imports(path: Path):
    """(target package, imported names) of every relative import in ``path``, lazy ones included."""
    rel = path.relative_to(ROOT / "torchqkit").parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(rel[:-1])[: len(rel) - node.level] if node.level > 1 else list(rel[:-1])
            parts = base + (node.module.split(".") if node.module else [])
            target = parts[0].removesuffix(".py") if parts else "__init__"
            yield target, [a.name for a in node.names]


def test_packages_import_only_the_layers_below_them():
    wrong = []
    for path in sorted((ROOT / "torchqkit").rglob("*.py")):
        rel = path.relative_to(ROOT / "torchqkit").parts
        package = rel[0].removesuffix(".py")
        for target, names in _relative_imports(path):
            if target == package:
                continue
            if _RANK[target] >= _RANK[package] and not {target, package} <= {"__main__", "__init__"}:
                wrong.append(f"{path.relative_to(ROOT)} imports {target} (layer {_RANK[target]} >= {_RANK[package]})")
            wrong += [f"{path.relative_to(ROOT)} imports private {target}.{n}" for n in names
                      if n.startswith("_") and not n.startswith("__")]
    assert not wrong, "\n".join(wrong)


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    suffixes = {".py", ".md", ".sh", ".cpp", ".h", ".cu", ".inc", ".txt", ".yml", ".yaml", ".toml", ".cfg", ""}
    return [ROOT / n for n in names if (ROOT / n).suffix in suffixes and (ROOT / n).is_file()]


def test_no_file_names_a_path_of_a_development_machine_notes_outside_the_repository_or_a_session():
    """What the code and docs cite lives in the repository (docs/), and nothing points into one machine's folders."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    # a development machine's folders (spelled in parts, so this file passes its own check), notes kept outside
    machine_dirs = "|".join(f"/{d}/" for d in ("work", "root", "home"))
    pattern = re.compile(machine_dirs + r"|\.\./shared/|(?<![\w/])(?:PLATFORM|DESIGN|STYLE)\.md"
                         r"|\b[Ss]essions? \d")  # and no development narration: history is dated (CHANGELOG.md)
    offenders = []
    for path in _tracked_text_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_docs_that_the_code_cites_exist():
    cited = set()
    for path in _tracked_text_files():
        cited.update(re.findall(r"docs/[\w/.-]+\.md", path.read_text(errors="replace")))
    assert cited, "nothing cites docs/: the pattern is broken"
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"cited but not in the repository: {missing}"


def test_links_in_the_readme_and_docs_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)


def test_every_guarantee_names_test_files_that_exist():
    text = (ROOT / "docs" / "reference" / "guarantees.md").read_text()
    named = set(re.findall(r"`(test_\w+\.py)`", text))
    assert len(named) >= 10, "the guarantees page names its tests in backquotes"
    missing = sorted(n for n in named if not (ROOT / "test" / "reliability" / n).is_file())
    assert not missing, f"docs/reference/guarantees.md names tests that don't exist: {missing}"
