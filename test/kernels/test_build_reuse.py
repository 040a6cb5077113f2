"""Note [Reusing a build] (torchqkit/kernels/cpu_build.py): a second install reuses the C++ library built from
the same sources, and rebuilds when a source, a setting or the request changes."""
from __future__ import annotations

from torchqkit.kernels import cpu_build


def _tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [root / "cpu", root / "common"]


def test_the_fingerprint_follows_every_source_byte_and_setting(tmp_path):
    dirs = _tree(tmp_path, {"cpu/a.cpp": "int a;", "cpu/b.h": "int b;", "common/c.h": "int c;"})
    base = cpu_build.source_fingerprint(dirs, "flags torch-2.13")
    assert cpu_build.source_fingerprint(dirs, "flags torch-2.13") == base
    assert cpu_build.source_fingerprint(dirs, "flags torch-2.14") != base
    (tmp_path / "common" / "c.h").write_text("int c; ")
    changed = cpu_build.source_fingerprint(dirs, "flags torch-2.13")
    assert changed != base
    (tmp_path / "common" / "c.h").write_text("int c;")
    (tmp_path / "cpu" / "new.inc").write_text("")
    assert cpu_build.source_fingerprint(dirs, "flags torch-2.13") not in (base, changed)


def test_a_library_is_reused_only_with_its_own_fingerprint(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHQKIT_REBUILD_CPU", raising=False)
    library = tmp_path / "_C_cpu.abi3.so"
    assert not cpu_build.reusable_build(str(library), "f1")          # nothing built
    library.write_bytes(b"\x7fELF")
    assert not cpu_build.reusable_build(str(library), "f1")          # built, no fingerprint: an unknown build
    cpu_build.write_fingerprint(str(library), "f1")
    assert cpu_build.reusable_build(str(library), "f1")
    assert not cpu_build.reusable_build(str(library), "f2")          # other sources or settings
    monkeypatch.setenv("TORCHQKIT_REBUILD_CPU", "1")
    assert not cpu_build.reusable_build(str(library), "f1")          # asked for a build
