"""A C++ CPU extension that failed to build (or doesn't load) is never silent: ``import torchqkit`` warns once with
KernelsMissingWarning (why, and the command that rebuilds it), the CLI prints the same note, and setup.py ends a
failed build with a warning block; none of it when the extension loads or its absence was asked for. See Note
[Missing CPU kernels] in torchqkit/kernels/cpu_build.py. Each case imports a copy of the package (without the
extension) in a fresh process."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchqkit as qk
from torchqkit import kernels
from torchqkit.kernels import cpu_build, missing

REPO = Path(__file__).resolve().parents[2]
REBUILD = "pip install --no-build-isolation -e ."
ON_KERNEL_CPU = pytest.mark.skipif(not cpu_build.cpu_has_kernels(), reason="csrc/cpu has no kernels for this CPU")


@pytest.fixture(scope="module")
def bare_package(tmp_path_factory) -> Path:
    """A copy of torchqkit without its compiled extension (an install whose build failed)."""
    root = tmp_path_factory.mktemp("bare")
    shutil.copytree(REPO / "torchqkit", root / "torchqkit",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", cpu_build.BUILD_RECORD))
    return root


def _run(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in (cpu_build.SILENCE_ENV, "TORCHQKIT_DISABLE_CPU_EXTENSION", "TORCHQKIT_BUILD_CPU",
                          "PYTHONWARNINGS")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=root,
                          env={**clean, "PYTHONPATH": str(root), **(env or {})}, timeout=300)


IMPORT = ["-c", "import torchqkit, torchqkit.kernels, torchqkit.cli; print(torchqkit.__file__)"]


@ON_KERNEL_CPU
def test_missing_extension_warns_once_with_reason_and_command(bare_package):
    done = _run(bare_package, *IMPORT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(bare_package / "torchqkit" / "__init__.py")  # the copy, not the checkout
    assert done.stderr.count("KernelsMissingWarning") == 1
    assert "torchqkit._C_cpu is not built" in done.stderr
    assert REBUILD in done.stderr and "TORCHQKIT_NO_KERNELS_WARNING=1" in done.stderr


@ON_KERNEL_CPU
def test_extension_that_fails_to_load_warns_with_the_loader_error(bare_package, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(bare_package, root)
    (root / "torchqkit" / "_C_cpu.abi3.so").write_bytes(b"not a shared library")
    done = _run(root, *IMPORT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("KernelsMissingWarning") == 1
    assert re.search(r"loading .*_C_cpu\.abi3\.so failed", done.stderr)


@ON_KERNEL_CPU
def test_failed_build_record_is_quoted(bare_package, tmp_path):
    root = tmp_path / "failed"
    shutil.copytree(bare_package, root)
    cpu_build.write_record(root / "torchqkit", deliberate=False, reason="building torchqkit._C_cpu failed: cc1plus: "
                                                                      "Killed signal terminated program")
    done = _run(root, *IMPORT)
    assert done.stderr.count("KernelsMissingWarning") == 1
    assert "setup.py: building torchqkit._C_cpu failed: cc1plus: Killed signal" in done.stderr


@pytest.mark.parametrize("how", ["silenced", "disabled", "built_without", "recorded_deliberate"])
def test_no_warning_when_the_absence_was_asked_for(bare_package, tmp_path, how):
    root, env = bare_package, {}
    if how == "recorded_deliberate":
        root = tmp_path / "deliberate"
        shutil.copytree(bare_package, root)
        cpu_build.write_record(root / "torchqkit", deliberate=True, reason="TORCHQKIT_BUILD_CPU=0 at install time")
    else:
        env = {"silenced": {cpu_build.SILENCE_ENV: "1"}, "disabled": {"TORCHQKIT_DISABLE_CPU_EXTENSION": "1"},
               "built_without": {"TORCHQKIT_BUILD_CPU": "0"}}[how]
    done = _run(root, "-W", "default", "-c", "import torchqkit; print(torchqkit.kernels.CPU_EXTENSION_REASON)", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    if how == "recorded_deliberate":
        assert "setup.py: TORCHQKIT_BUILD_CPU=0 at install time" in done.stdout  # status() still says why


@ON_KERNEL_CPU
def test_cli_prints_the_note_once_even_when_warnings_are_filtered(bare_package):
    for flags in ([], ["-W", "ignore"]):
        done = _run(bare_package, *flags, "-m", "torchqkit", "demo", "--help")
        assert done.returncode == 0, done.stderr
        assert done.stderr.count("the C++ CPU kernels are not loaded") == 1, (flags, done.stderr)


def test_no_warning_when_the_extension_loads_or_the_cpu_has_no_kernels(monkeypatch):
    if kernels.CPU_EXTENSION_LOADED:
        assert kernels.MISSING_KERNELS_NOTE is None
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "aarch64")
    for var in (cpu_build.SILENCE_ENV, "TORCHQKIT_DISABLE_CPU_EXTENSION", "TORCHQKIT_BUILD_CPU"):
        monkeypatch.delenv(var, raising=False)
    assert missing.missing_kernels_note(False, "not built", None) is None
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    assert "not built" in missing.missing_kernels_note(False, "not built", None)
    assert qk.KernelsMissingWarning is kernels.KernelsMissingWarning and issubclass(qk.KernelsMissingWarning, UserWarning)


def test_unreadable_build_record_counts_as_no_record(tmp_path):
    (tmp_path / cpu_build.BUILD_RECORD).write_text('{"deliberate": "yes"}')
    assert cpu_build.read_record(tmp_path) is None
    (tmp_path / cpu_build.BUILD_RECORD).write_bytes(b"\xff\xfe")
    assert cpu_build.read_record(tmp_path) is None


def test_failed_build_ends_with_a_warning_block_and_a_record(tmp_path):
    """setup.py's build_ext with every C++ source replaced by one that can't compile: the build completes (the
    extension is optional), ends with the warning block, and records the failure where the extension goes."""
    shutil.copy(REPO / "setup.py", tmp_path)
    (tmp_path / "torchqkit" / "kernels").mkdir(parents=True)
    shutil.copy(REPO / "torchqkit" / "kernels" / "cpu_build.py", tmp_path / "torchqkit" / "kernels")
    for source in re.findall(r"csrc/cpu/\w+\.cpp", (REPO / "setup.py").read_text()):
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).write_text("#error this compile must fail\n")
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "tmp"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "MAX_JOBS": "1", "TORCHQKIT_BUILD_CPU": "1", "TORCHQKIT_BUILD_CUDA": "0"})
    if not cpu_build.cpu_has_kernels():
        assert done.returncode == 0 and not (tmp_path / "out").exists()
        return
    assert done.returncode == 0, done.stderr[-2000:]
    block = done.stderr[done.stderr.index("torchqkit WARNING"):]
    assert "building torchqkit._C_cpu failed" in block and REBUILD in block
    for where in (tmp_path / "out" / "torchqkit", tmp_path / "torchqkit"):
        record = cpu_build.read_record(where)
        assert record is not None and not record["deliberate"]
        assert record["reason"].startswith("building torchqkit._C_cpu failed")
