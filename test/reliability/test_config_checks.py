"""Config fields are checked against their annotations when a config is built (QuantConfig.__post_init__,
Note [Config field checks] in api/configs/base.py), for every registered config, including ones whose
files define no checks of their own; JSON files and headers fail with the loader's own error, never
RecursionError / UnicodeDecodeError."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import torchqkit as qk
from torchqkit.api.configs import base

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("make,error,match", [
    (lambda: qk.Int8WeightOnlyConfig(group_size=0), ValueError, "group_size must be >= 1 \\(or None\\), got 0"),
    (lambda: qk.Int8WeightOnlyConfig(group_size=-1), ValueError, "group_size must be >= 1"),
    (lambda: qk.Int8WeightOnlyConfig(group_size="64"), TypeError, "group_size must be an int, got '64'"),
    (lambda: qk.Int8WeightOnlyConfig(group_size=1.5), TypeError, "group_size must be an int"),
    (lambda: qk.Int8WeightOnlyConfig(group_size=True), TypeError, "group_size must be an int, got True"),
    (lambda: qk.IntxWeightOnlyConfig(bits=True), TypeError, "bits must be an int"),
    (lambda: qk.Int4WeightOnlyConfig(group_size=64.0), TypeError, "group_size must be an int"),
    (lambda: qk.NF4WeightOnlyConfig(double_quant="yes"), TypeError, "double_quant must be True or False"),
    (lambda: qk.Int8WeightOnlyConfig(layout="bogus"), ValueError, "unknown layout 'bogus'; known layouts"),
    (lambda: qk.Int8WeightOnlyConfig(layout=7), TypeError, "layout must be a Layout or a layout name"),
    (lambda: qk.IntxWeightOnlyConfig(granularity=32), TypeError, "granularity must be a Granularity"),
    (lambda: qk.Int8WeightOnlyConfig(kernel_preference="fastest"), ValueError, "kernel_preference must be one of"),
    (lambda: qk.Float8StaticActivationFloat8WeightConfig(act_scale=float("inf")), ValueError, "must be finite"),
    (lambda: qk.Int8DynamicActivationIntxWeightConfig(weight_bits=False), TypeError, "weight_bits must be an int"),
])
def test_bad_field_values_fail_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_layout_names_are_layouts():
    config = qk.Int8WeightOnlyConfig(layout="plain")
    assert config == qk.Int8WeightOnlyConfig(layout=qk.PlainLayout())
    assert qk.config_from_dict(config.to_dict()) == config


def _fields_of_type(cls, wanted):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is wanted or wanted in typing.get_args(hint):
            yield f.name


_REQUIRED = {"Float8StaticActivationFloat8WeightConfig": {"act_scale": 1.0}}


@pytest.mark.parametrize("name", qk.known_configs())
def test_every_registered_config_checks_its_int_bool_and_float_fields(name):
    cls = base._CONFIGS[name]
    required = _REQUIRED.get(name, {})
    cls(**required)  # the defaults pass
    for field in _fields_of_type(cls, int):
        for bad in (True, 2.0, "2"):
            with pytest.raises(TypeError, match=field):
                cls(**{**required, field: bad})
    for field in _fields_of_type(cls, bool):
        with pytest.raises(TypeError, match=field):
            cls(**{**required, field: 1})
    for field in _fields_of_type(cls, float):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=field):
                cls(**{**required, field: bad})
    for field in _fields_of_type(cls, str):
        with pytest.raises((TypeError, ValueError), match=field):
            cls(**{**required, field: 3})


def _deep(n: int) -> str:
    return '{"_default": ' + "[" * n + "]" * n + "}"


@pytest.mark.parametrize("content,match", [(_deep(100_000).encode(), "nested too deeply"),
                                           (_deep(40).encode(), "nested too deeply"),
                                           (b'{"_default": null, "x": \xff}', "not UTF-8"),
                                           (b'{"_default": NaN}', "NaN is not a JSON number"),
                                           (b'{"a": null, "a": null}', "same key twice")])
def test_module_configs_json_errors_name_the_file(tmp_path, content, match):
    path = tmp_path / "quant.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        qk.ModuleConfigs.from_json(path)
    assert str(path) in str(err.value)


def test_cli_config_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "quant.json"
    bad.write_bytes(_deep(50_000).encode())
    proc = subprocess.run([sys.executable, "-m", "torchqkit", "quantize", str(tmp_path / "in.safetensors"),
                           str(tmp_path / "out.safetensors"), "--config", str(bad)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "nested too deeply" in proc.stderr and "Traceback" not in proc.stderr


def _saved(tmp_path, sharded: bool):
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    qk.save_quantized(model, tmp_path / "model.safetensors", max_shard_bytes=600 if sharded else None)


def _load(tmp_path):
    import torch
    return qk.load_quantized(torch.nn.Sequential(torch.nn.Linear(32, 32)), tmp_path)


def _rewrite_header(path: Path, text: bytes) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


@pytest.mark.parametrize("text,match", [(_deep(100_000).encode(), "nested too deeply"),
                                        (b'{"__metadata__": {"x": "\xff"}}', "not UTF-8")])
def test_safetensors_header_json_errors_are_checkpoint_errors(tmp_path, text, match):
    _saved(tmp_path, sharded=False)
    _rewrite_header(tmp_path / "model.safetensors", text)
    with pytest.raises(qk.CheckpointError, match=match):
        _load(tmp_path)


def test_torchqkit_header_json_errors_are_checkpoint_errors(tmp_path):
    import json
    _saved(tmp_path, sharded=False)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    for value, match in ((_deep(100_000), "nested too deeply"), ('{"format_version": Infinity}', "Infinity")):
        header["__metadata__"]["torchqkit"] = value
        _rewrite_header(path, json.dumps(header).encode())
        with pytest.raises(qk.CheckpointError, match=match):
            _load(tmp_path)


@pytest.mark.parametrize("text,match", [(_deep(100_000).encode(), "nested too deeply"),
                                        (b'{"weight_map": {"a": "\xff"}}', "not UTF-8")])
def test_index_json_errors_are_checkpoint_errors(tmp_path, text, match):
    _saved(tmp_path, sharded=True)
    (tmp_path / "model.safetensors.index.json").write_bytes(text)
    with pytest.raises(qk.CheckpointError, match=match):
        _load(tmp_path)
