"""transformers clients read torchqkit checkpoints without importing torchqkit: the installed .pth runs
_torchqkit_startup at interpreter start (Note [Registering with transformers at interpreter start]).

Each test starts a fresh interpreter that processes the very .pth line the wheel ships (``site.addsitedir`` on a
folder holding it is what ``site`` does for site-packages) and never imports torchqkit itself."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import _torchqkit_startup
import torchqkit as qk
from test.common import small_hf_llama

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
IDS = torch.arange(24).reshape(2, 12) * 5 % 128


def _run(tmp_path, code: str, **env) -> subprocess.CompletedProcess:
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir(exist_ok=True)
    (site_dir / _torchqkit_startup.PTH_NAME).write_text(_torchqkit_startup.PTH_LINE)
    prelude = f"import site, sys\nsite.addsitedir({str(site_dir)!r})\n"
    full_env = {k: v for k, v in os.environ.items() if k != _torchqkit_startup.SWITCH}
    full_env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240, env=full_env, cwd=tmp_path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = small_hf_llama(init_std=None)
    config = qk.ModuleConfigs({r"re:.*\.mlp\..*": qk.NF4WeightOnlyConfig(block_size=32),
                               "_default": qk.Int4WeightOnlyConfig(group_size=32)})
    qk.quantize_(model, config)
    path = tmp_path_factory.mktemp("int4")
    qk.save_pretrained(model, path, config=config)
    return path


@torch.no_grad()
def test_from_pretrained_without_importing_torchqkit(checkpoint, tmp_path, monkeypatch):
    # Bit-equal logits across two processes: both take the kernels' rule routes, since each process measures its own
    # (Note [Routes chosen by measurement]: exact routes that may round differently)
    monkeypatch.setenv("TORCHQKIT_CPU_ROUTES", "rules")
    run = _run(tmp_path, f"""
        import torch, transformers
        assert "torchqkit" not in sys.modules and "_torchqkit_startup" in sys.modules
        from transformers import AutoModelForCausalLM
        # from_pretrained imports transformers.quantizers.auto, right after which the hook imports torchqkit
        model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r})
        assert "torchqkit" in sys.modules
        print(type(model.model.layers[0].mlp.up_proj.weight).__name__)
        torch.save(model(torch.arange(24).reshape(2, 12) * 5 % 128).logits, "logits.pt")
    """, TORCHQKIT_CPU_ROUTES="rules")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["AffineQuantizedTensor"]
    expected = qk.from_pretrained(checkpoint)(IDS).logits
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)


def test_off_switch(tmp_path):
    run = _run(tmp_path, """
        import transformers.quantizers.auto as auto
        assert "torchqkit" not in auto.AUTO_QUANTIZER_MAPPING, "registered although switched off"
        assert "_torchqkit_startup" not in sys.modules and "torchqkit" not in sys.modules
    """, **{_torchqkit_startup.SWITCH: "1"})
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_broken_torchqkit_never_breaks_transformers(tmp_path):
    """The hook runs inside transformers' import: if torchqkit can't be imported, transformers still works."""
    broken = tmp_path / "broken"
    (broken / "torchqkit").mkdir(parents=True)
    (broken / "torchqkit" / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    run = _run(tmp_path, f"""
        import warnings
        sys.path.insert(0, {str(broken)!r})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import transformers.quantizers.auto as auto
        assert "torchqkit" not in auto.AUTO_QUANTIZER_MAPPING
        print([str(w.message) for w in caught if "torchqkit" in str(w.message)][0])
    """)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torchqkit is installed but could not be imported (ImportError: simulated broken install)" in run.stdout
    assert _torchqkit_startup.SWITCH in run.stdout


def test_pth_line_is_one_import_line():
    """site runs a .pth line only when it starts with "import", and only one line at a time."""
    line = _torchqkit_startup.PTH_LINE
    assert line.startswith("import ") and line.count("\n") == 1 and line.endswith("\n")


def test_pth_line_is_silent_when_the_package_is_gone(tmp_path):
    """An editable install whose checkout was deleted leaves the .pth with nothing to import: no traceback at start."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    (site_dir / _torchqkit_startup.PTH_NAME).write_text(_torchqkit_startup.PTH_LINE)
    # -S: no site-packages, so neither the installed package nor its editable finder can supply _torchqkit_startup
    code = (f"import site, sys; site.addsitedir({str(site_dir)!r}); "
            "print('_torchqkit_startup' in sys.modules, 'torchqkit' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", _torchqkit_startup.SWITCH)}
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.split() == ["False", "False"]
