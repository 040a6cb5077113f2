"""User-supplied "re:" patterns (ModuleConfigs keys, also from JSON files, checkpoint headers and the CLI) run in
bounded time: a pattern that doesn't compile, can backtrack exponentially or would take too long on a module name
is refused with an error naming it, before anything is quantized. See Note [Bounded name patterns] in
torchqkit/api/name_patterns.py."""
from __future__ import annotations

import copy
import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import torchqkit as qk
from torchqkit.api.name_patterns import MAX_PATTERN_CHARS, TYPICAL_NAME_CHARS, NamePattern

from .models import mlp

INT8 = qk.Int8WeightOnlyConfig()
REPO = Path(__file__).resolve().parents[2]

# Every pattern the README, the docstrings and the test suite use, plus common shapes users write.
DOCUMENTED = [r"layers\.\d+\.mlp\..*", r".*\.mlp\..*", r".*mlp.*", r"u.*", r"layers\.0\..*", r"layers\.1\..*",
              r".*\.q_prj", r".*\.down_proj", r".*\.k_proj", r"layers\.\d+\.q_proj", r"layers\.\d+\.qproj"]
COMMON = [r"(q|k|v|o)_proj", r"model\.layers\.([0-9]|1[0-5])\.self_attn\.(q|k|v)_proj", r"(?!lm_head).*",
          r".*\.(up|gate|down)_proj", r"(?i).*MLP.*", r".*layers\.\d+\..*mlp.*", r"(?:(?!lm_head).)*",
          r"encoder\.layer\.\d{1,2}\.(attention|output)\..*"]

HOSTILE = {  # pattern -> what the error says is wrong
    r"(a+)+$": "a repeat inside a repeated group",
    r"(\w+\.)*mlp": "a repeat inside a repeated group",
    r"(a?){40}b": "a repeat inside a repeated group",
    r"(a|ab)*c": "alternation '|' inside a repeated group",
    r"(.*)\1": "backreference",
    r"(a)?(?(1)b|c)": "conditional group",
    r".*.*.*.*.*.*.*!": "too many repeats",
    "a" * (MAX_PATTERN_CHARS + 1): f"more than {MAX_PATTERN_CHARS}",
    r"layers\.(\d+": "not a valid regular expression",
}


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules()]


@pytest.mark.parametrize("pattern", DOCUMENTED + COMMON)
def test_documented_and_common_patterns_are_accepted(pattern):
    configs = qk.ModuleConfigs({f"re:{pattern}": INT8})
    for name in ("layers.3.mlp.up_proj", "lm_head", "model.layers.12.self_attn.k_proj", "x" * TYPICAL_NAME_CHARS):
        assert (configs.lookup(name)[0] is not None) == (re.fullmatch(pattern, name) is not None)


def test_documented_pattern_still_quantizes_what_it_names():
    model = nn.Module()
    model.layers = nn.ModuleList(nn.ModuleDict({"mlp": nn.Linear(32, 32), "attn": nn.Linear(32, 32)}) for _ in range(2))
    report = qk.quantize_(model, qk.ModuleConfigs({r"re:layers\.\d+\.mlp": INT8}))
    quantized = sorted(e.fqn for e in report.entries if e.status == "quantized")
    assert quantized == ["layers.0.mlp", "layers.1.mlp"]


@pytest.mark.parametrize("pattern,problem", HOSTILE.items(), ids=lambda v: v[:24])
def test_hostile_pattern_is_refused_naming_it(pattern, problem):
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        qk.ModuleConfigs({f"re:{pattern}": INT8})
    assert time.perf_counter() - start < 1.0
    message = str(err.value)
    assert problem in message
    assert repr(f"re:{pattern}") in message  # the key, as the user wrote it


def test_refusal_explains_the_rule():
    with pytest.raises(ValueError, match=r"no timeout.*no backreferences.*exact keys"):
        qk.ModuleConfigs({"re:(a+)+$": INT8})


def _float_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 32)).eval()


def test_hostile_pattern_leaves_the_model_unchanged():
    model = _float_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="repeated group"):
        qk.quantize_(model, qk.ModuleConfigs({"re:(0+)+$": INT8}))
    after = model.state_dict()
    assert all(type(after[k]) is type(v) and after[k].equal(v) for k, v in before.items())


def test_a_pattern_too_slow_for_a_long_name_fails_before_quantizing():
    # four '.*' are fine on names of usual length, but the bound grows as length^4
    pattern = r".*a.*b.*c.*d"
    qk.ModuleConfigs({f"re:{pattern}": INT8}).lookup("layers.0.mlp")
    model = nn.Module()
    long = nn.Module()
    model.add_module("m" * 400, long)
    long.proj = nn.Linear(8, 8)
    weight = long.proj.weight
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"can't be matched against the module name 'm{80}'\.\.\. \(400 characters\)"):
        qk.quantize_(model, qk.ModuleConfigs({f"re:{pattern}": INT8}))
    assert time.perf_counter() - start < 1.0
    assert long.proj.weight is weight


def test_bound_holds_on_adversarial_names():
    # the worst accepted shapes on names built to make them backtrack: each match stays well under a second
    for pattern, name in [(r"\d*\d*\d*\d*x", "1" * 100), (r".*a.*a.*a.*b", "a" * 100), (r"(?=.*x).*.*y", "x" * 100)]:
        compiled = NamePattern(pattern, pattern)
        start = time.perf_counter()
        assert not compiled.fullmatch(name)
        assert time.perf_counter() - start < 0.5


def test_pattern_from_a_json_file_names_the_file(tmp_path):
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"re:(x+)+y": INT8.to_dict()}))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: ModuleConfigs key 're:\(x\+\)\+y'"):
        qk.ModuleConfigs.from_json(path)


def test_pattern_in_a_checkpoint_header_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    configs = qk.ModuleConfigs({"re:0": INT8})
    qk.save_quantized(mlp(0, configs), path, config=configs)
    with safe_open(path, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    assert '"re:0"' in metadata["torchqkit"]
    metadata["torchqkit"] = metadata["torchqkit"].replace('"re:0"', '"re:(0+)+"')
    save_file(tensors, path, metadata)
    with pytest.raises(qk.CheckpointError, match=r"model\.safetensors.*'re:\(0\+\)\+'.*repeated group"):
        qk.load_quantized(_float_mlp(), path)


def test_cli_refuses_a_hostile_pattern_in_seconds(tmp_path):
    config = tmp_path / "configs.json"
    config.write_text(json.dumps({"re:(a+)+$": INT8.to_dict()}))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torchqkit", "quantize", str(tmp_path / "in"), str(tmp_path / "out"),
                           "--config", str(config)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert time.perf_counter() - start < 60
    assert done.returncode == 2
    assert "'re:(a+)+$'" in done.stderr and "repeated group" in done.stderr


def test_configs_with_patterns_copy_and_pickle():
    configs = qk.ModuleConfigs({r"re:layers\.\d+\.mlp\..*": INT8, "_default": None})
    for twin in (copy.deepcopy(configs), pickle.loads(pickle.dumps(configs))):
        assert twin == configs
        assert twin.lookup("layers.2.mlp.fc1")[0] == r"re:layers\.\d+\.mlp\..*"
