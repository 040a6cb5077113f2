"""The documentation site builds with every warning as an error, and its reference pages cover what the code has.

`mkdocs build --strict` checks every internal link and anchor and renders the API reference from the docstrings
(mkdocstrings); the other tests check that the pages listing notes, environment variables, ops and public names
are complete, so a new one can't go undocumented.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torchqkit as qk
from torchqkit.kernels import registry

from . import docs_index

DOCS = docs_index.ROOT / "docs"


def test_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=docs_index.ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "WARNING" not in run.stderr, run.stderr
    api = (tmp_path / "site" / "reference" / "api" / "quantize" / "index.html").read_text()
    assert "strict" in api and "QuantizationReport" in api  # rendered from the docstrings, not an empty page


def test_every_public_name_has_an_api_entry():
    pages = "\n".join(p.read_text() for p in (DOCS / "reference" / "api").glob("*.md"))
    entries = set(re.findall(r"^::: torchqkit\.(?:[\w.]+\.)?(\w+)$", pages, re.M))
    missing = [name for name in qk.__all__ if name != "__version__" and name not in entries]
    assert not missing, f"public names without an entry in docs/reference/api/: {missing}"


def test_notes_index_is_complete_and_every_cited_note_exists():
    assert (DOCS / "contributing" / "notes.md").read_text() == docs_index.notes_page(), (
        "docs/contributing/notes.md is out of date: run python test/docs_index.py")
    defined, cited = docs_index.note_definitions(), docs_index.note_citations()
    undefined = {title: sorted(files) for title, files in cited.items() if title not in defined}
    assert not undefined, f"notes cited but defined nowhere (define them, or cite the right title): {undefined}"


def test_environment_page_lists_every_variable_read():
    page = (DOCS / "reference" / "environment.md").read_text()
    listed = set(re.findall(r"^\| `(TORCHQKIT_[A-Z0-9_]+)`", page, re.M))
    read = docs_index.environment_variables()
    assert read - listed == set(), f"read by the code, missing from docs/reference/environment.md: {read - listed}"
    assert listed - read == set(), f"documented but never read: {listed - read}"


def test_kernels_page_names_every_op():
    page = (DOCS / "reference" / "kernels.md").read_text()
    ops = {name.split("::")[1] for name in registry.OPS}  # every torchqkit:: op, with or without a kernel
    assert "linear_int4wo_tiled" in ops and "sdpa_over_filled_cache" in ops
    missing = sorted(op for op in ops if f"`{op}`" not in page)
    assert not missing, f"ops missing from docs/reference/kernels.md: {missing}"
