"""Failed and killed saves leave no files behind (Note [Atomic writes], Note [Stale temporaries] in
torchqkit/files/atomic_write.py): a save that fails part-way removes its temporaries even when closing them fails
again, and the next save of a destination removes what killed saves of it left, never a live save's."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import torchqkit as qk
from torchqkit.files import atomic_write

from .models import listing, meta_mlp, mlp, outputs, temporaries

SHARD = 6000  # bytes: the test MLP makes 3 shards


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.parametrize("max_shard_bytes", [None, SHARD], ids=["single", "sharded"])
def test_a_save_past_the_file_size_limit_fails_whole_and_leaves_no_temporary(tmp_path, max_shard_bytes):
    """The process's file size limit (RLIMIT_FSIZE) makes a write fail part-way, and closing the file (which
    flushes the bytes that failed) fails again: the old checkpoint stays loadable and no temporary remains."""
    path = tmp_path / "model.safetensors"
    qk.save_quantized(mlp(0), path, max_shard_bytes=max_shard_bytes)
    before = listing(tmp_path)
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(__file__)))!r})
        import torchqkit as qk
        from test.reliability.models import mlp
        model = mlp(1)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
        try:
            qk.save_quantized(model, {str(path)!r}, max_shard_bytes={max_shard_bytes!r})
        except OSError as e:
            print("failed:", e.errno)
            sys.exit(0)
        sys.exit("the save did not fail")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCHQKIT_NO_KERNELS_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "failed: 27" in run.stdout  # EFBIG
    assert temporaries(tmp_path) == []
    assert listing(tmp_path) == before
    fresh = meta_mlp()
    qk.load_quantized(fresh, path)
    torch.testing.assert_close(outputs(fresh), outputs(mlp(0)), rtol=0, atol=0)


def test_the_abort_path_removes_the_temporary_when_closing_raises_again(tmp_path, monkeypatch):
    class FailingFile:
        """A file whose every write and close fail, as a full disk's buffered bytes do."""
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(28, "No space left on device")

        def fileno(self):
            return self.f.fileno()

        def flush(self):
            raise OSError(28, "No space left on device")

        def close(self):
            self.f.close()
            raise OSError(28, "No space left on device")

    real = atomic_write.temp_file
    monkeypatch.setattr(atomic_write, "temp_file", lambda final: (lambda f, t: (FailingFile(f), t))(*real(final)))
    with pytest.raises(OSError, match="No space"):
        atomic_write.atomic_write_bytes(tmp_path / "config.json", b"{}")
    assert os.listdir(tmp_path) == []


def _stale(directory, name, age_seconds, tag="abcd1234"):
    path = directory / f".{name}.{tag}.tmp"
    path.write_bytes(b"partial")
    then = time.time() - age_seconds
    os.utime(path, (then, then))
    return path


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_the_next_save_removes_what_killed_saves_of_it_left(tmp_path):
    path = tmp_path / "model.safetensors"
    old = 3600
    killed = [_stale(tmp_path, "model.safetensors", old), _stale(tmp_path, "model.safetensors.index.json", old),
              _stale(tmp_path, "model-0123abcd-00001-of-00003.safetensors", old)]
    recent = _stale(tmp_path, "model.safetensors", 5, tag="x_9y8z7w")            # could be a save that just started
    other = _stale(tmp_path, "other.safetensors", old)            # another destination's
    user_file = tmp_path / ".model.safetensors.notes.tmp"          # not a temporary name torchqkit makes
    user_file.write_text("mine")
    os.utime(user_file, (time.time() - old,) * 2)
    qk.save_quantized(mlp(0), path, max_shard_bytes=SHARD)
    assert not any(p.exists() for p in killed)
    assert recent.exists() and other.exists() and user_file.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_temporary_locked_by_a_running_save_is_never_removed(tmp_path):
    path = tmp_path / "model.safetensors"
    live = _stale(tmp_path, "model.safetensors", 3600)  # old, but its writer is alive and holds it locked
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(live)!r}, "rb")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        qk.save_quantized(mlp(0), path)
        assert live.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    qk.save_quantized(mlp(0), path)  # the holder is gone: its lock went with it
    assert not live.exists()


def test_a_save_keeps_its_own_temporaries_locked_until_they_are_renamed(tmp_path):
    f, tmp = atomic_write.temp_file(tmp_path / "model.safetensors")
    f.write(b"x")
    atomic_write.finish_temp(f, tmp)  # closed, waiting to be renamed (a shard of a sharded save)
    then = time.time() - 3600
    os.utime(tmp, (then, then))
    assert atomic_write.remove_stale_temps(tmp_path, ["model.safetensors"]) == []
    atomic_write.replace_temp(tmp, tmp_path / "model.safetensors")
    assert os.listdir(tmp_path) == ["model.safetensors"]
