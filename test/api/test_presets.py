"""qk.presets: one name per config, the same for the demo, `quantize --config` and `eval --config`."""
from __future__ import annotations

import argparse

import pytest

import torchqkit as qk
from torchqkit import demo
from torchqkit.serialization.cli import parse_config_arg


def test_every_preset_builds_a_fresh_config_that_round_trips():
    assert qk.presets.names()[0] == "int8-wo" and "int4-wo-g128" in qk.presets.names()
    for name in qk.presets.names():
        a, b = qk.presets.get(name), qk.presets.get(name)
        assert isinstance(a, (qk.QuantConfig, qk.ModuleConfigs)) and a == b and a is not b
        if isinstance(a, qk.ModuleConfigs):  # body + output layer: Note [The output layer]
            assert set(a.configs) == {"lm_head", "_default"} and qk.ModuleConfigs.from_dict(a.to_dict()) == a
        else:
            assert qk.config_from_dict(a.to_dict()) == a
    assert qk.presets.get("int4-wo-g128") == qk.Int4WeightOnlyConfig(group_size=128)


def test_unknown_names_list_the_presets():
    with pytest.raises(ValueError, match="unknown preset 'int4-g128'; presets: int8-wo, "):
        qk.presets.get("int4-g128")


def test_the_demo_and_the_clis_use_the_presets():
    assert demo.DEMO_CONFIGS is qk.presets.PRESETS
    assert set(demo.MAIN_CONFIGS) <= set(qk.presets.names())
    assert parse_config_arg("nf4-b64") == qk.presets.get("nf4-b64")
    with pytest.raises(argparse.ArgumentTypeError, match="neither a preset name"):
        parse_config_arg("no-such-preset")
