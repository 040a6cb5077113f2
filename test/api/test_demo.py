"""The `python -m torchqkit demo` command: packaged data, argument errors, and a real end-to-end run."""

import pytest

import torchqkit
from torchqkit import demo
from torchqkit.cli import main


def test_sentences_are_many_unique_and_non_empty():
    sentences = demo.load_sentences()
    assert len(sentences) >= 200
    assert len(set(sentences)) == len(sentences)
    assert all(s and s.strip() == s for s in sentences)  # no blank lines, no stray spaces


def test_limit_takes_the_first_sentences():
    assert demo.load_sentences(5) == demo.load_sentences()[:5]


@pytest.mark.parametrize("name", list(demo.DEMO_CONFIGS))
def test_every_demo_config_builds(name):
    # a body + output-layer preset is a ModuleConfigs (its lm_head entry: decoder models)
    assert isinstance(demo.DEMO_CONFIGS[name](), (torchqkit.QuantConfig, torchqkit.ModuleConfigs))


def test_unknown_config_names_the_known_ones():
    with pytest.raises(ValueError, match="known configs: int8-wo, int4-wo-g32"):
        demo.run_demo(["int8-wo", "int3-magic"], repeats=1)


def test_cli_rejects_unknown_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--config", "int3-magic"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "int3-magic" in err and "fp8-dyn-row" in err


def test_format_table_has_every_config_and_is_markdown():
    rows = [
        dict(config=name, bytes_before=43_057_152, bytes_after=11_000_000 + i, compression=3.9,
             mean_cos=0.99912, min_cos=0.99, fp32_seconds=0.6, quantized_seconds=0.9, time_ratio=1.5)
        for i, name in enumerate(demo.DEMO_CONFIGS)
    ]
    lines = demo.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert set(lines[1]) <= set("|-:")
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert len({line.count("|") for line in lines}) == 1
    for name, line in zip(demo.DEMO_CONFIGS, lines[2:]):
        assert line.startswith(f"| {name} ")
    assert "43.06" in lines[2] and "1.50x" in lines[2]


@pytest.fixture(scope="module")
def demo_rows():
    rows = demo.run_demo(["int8-wo", "int4-wo-g64"], repeats=1, sentences_limit=64)
    return {row["config"]: row for row in rows}


def test_int8_weight_only_on_minilm(demo_rows):
    row = demo_rows["int8-wo"]
    assert row["mean_cos"] >= 0.999
    assert row["min_cos"] <= row["mean_cos"]
    assert row["bytes_before"] == 43_057_152  # 37 float32 nn.Linear weights
    assert row["bytes_after"] < row["bytes_before"] / 3.5
    assert row["time_ratio"] > 0


def test_int4_weight_only_g64_on_minilm(demo_rows):
    row = demo_rows["int4-wo-g64"]
    assert row["mean_cos"] >= 0.96
    assert row["bytes_after"] < row["bytes_before"] / 6
    assert row["time_ratio"] > 0


def test_cli_prints_the_table(capsys):
    assert main(["demo", "--config", "int8-wo", "--repeats", "1", "--limit", "8"]) == 0
    out = capsys.readouterr().out
    assert "| config " in out and "| int8-wo " in out
    assert "linear served by: int8-wo -> " in out


def test_progress_line_per_config_when_asked(capsys):
    demo.run_demo(["int8-wo"], repeats=1, sentences_limit=8, progress=True)
    assert "demo [####################] 1/1 configs (100%)" in capsys.readouterr().err
