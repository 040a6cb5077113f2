"""python -m benchmarks: every group's --quick run writes records with the full schema, names that aren't groups or
presets are refused with the list of what is, and plot / report turn a results file into PNG files / markdown.

The groups run in this process (one import of torch and transformers for all of them), except those that need other
processes by design: targets (one per ISA level) and distributed (torchrun, 2 ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the benchmarks package lives next to torchqkit, outside the installed package

from benchmarks.__main__ import GROUPS, main  # noqa: E402
from benchmarks.common.configs import BASELINES, build  # noqa: E402
from benchmarks.common.records import FIELDS, Recorder, read_records  # noqa: E402

MACHINE = {"cpu", "logical_cpus", "threads", "l3_bytes", "isa", "torch_cpu_capability"}
# groups whose figures are memory-bound: each record carries the read bandwidth its run measured
WITH_BANDWIDTH = {"kernels", "targets", "decode", "prefill"}
IN_OTHER_PROCESSES = {"targets", "distributed"}


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, group, *args) -> list[dict]:
    out = tmp_path / f"{group}.jsonl"
    if group in IN_OTHER_PROCESSES:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.run([sys.executable, "-m", "benchmarks", group, "--quick", "--out", str(out), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert main([group, "--quick", "--out", str(out), *args]) == 0
    return read_records(out)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_quick_run_writes_records_with_the_full_schema(group, tmp_path):
    records = _run(tmp_path, group)
    assert records, f"{group} --quick wrote no records"
    for r in records:
        assert set(FIELDS) <= set(r), f"{group}: missing {set(FIELDS) - set(r)}"
        assert r["group"] == group and isinstance(r["shape"], dict) and r["shape"]
        assert r["value"] is None or isinstance(r["value"], (int, float))
        assert MACHINE <= set(r["machine"]) and r["torch_version"] == torch.__version__
        assert f"-m benchmarks {group}" in r["command"] and r["date"].endswith("+00:00")
        # every config is a preset, a <preset>+<change> variant, a float baseline, or the llama.cpp peer
        assert r["config"] == "llama.cpp" or build(r["config"]) is not None or r["config"] in BASELINES
        if group in WITH_BANDWIDTH:
            assert r["read_bw_gbs"] and r["read_bw_gbs"] > 0, r
    assert len({r["date"] for r in records}) == 1  # one run


def test_the_output_file_is_appended_to(tmp_path):
    first = _run(tmp_path, "kernels", "--configs", "int8-wo", "--ms", "1")
    both = _run(tmp_path, "kernels", "--configs", "int8-wo", "--ms", "1")
    assert len(both) == 2 * len(first)


def test_an_unknown_group_is_refused_with_the_list(capsys):
    assert main(["kernel"]) == 2
    err = capsys.readouterr().err
    assert "unknown group 'kernel'" in err and all(g in err for g in GROUPS)


@pytest.mark.parametrize("name, says", [("int4-g32", "is not a preset"), ("int4-wo-g32+nonsense", "unknown change"),
                                        ("nf4-b64+bits3", "has no bit width")])
def test_a_config_that_is_not_a_preset_is_refused_before_measuring(name, says, tmp_path, capsys):
    out = tmp_path / "k.jsonl"
    with pytest.raises(SystemExit) as exit_:
        main(["kernels", "--quick", "--out", str(out), "--configs", f"int8-wo,{name}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and not out.exists()
    if says == "is not a preset":
        assert "int4-wo-g32" in err  # the presets are listed


def test_every_group_default_config_is_a_preset_or_a_variant_of_one():
    import importlib
    for group in GROUPS:
        module = importlib.import_module(f"benchmarks.{group}")
        for attr in ("DEFAULT_CONFIGS", "QUICK_CONFIGS", "SPEED_CONFIGS", "WEIGHT_ONLY", "DYNAMIC"):
            for name in getattr(module, attr, ()):
                base = getattr(module, "config_of", lambda n: n)(name)
                assert base in BASELINES or build(base) is not None, f"{group}.{attr}: {name}"


def _results(folder: Path) -> Path:
    """A small results folder: kernels, decode and quality records as the groups write them."""
    folder.mkdir()
    kernels = Recorder("kernels", folder / "kernels.jsonl", ["--quick"])
    kernels.read_bw_gbs = 10.0
    for m, (t32, t4) in {1: (2.0, 0.5), 8: (2.2, 0.7), 32: (3.0, 2.5)}.items():
        shape = {"K": 1024, "N": 1024, "M": m}
        kernels.add("F.linear, f32 x", "float32", shape, "time", t32, "ms")
        kernels.add("torchqkit, f32 x", "int4-wo-g128", shape, "time", t4, "ms")
        kernels.add("torchqkit, f32 x", "int4-wo-g128", shape, "x fp32 F.linear", t32 / t4, "x")
    decode = Recorder("decode", folder / "decode.jsonl", ["--quick"])
    shape = {"model": "tiny", "new_tokens": 4, "cache": "-", "attention": "-"}
    decode.add("llama.cpp before", "llama.cpp", shape, "decode", 100.0, "tok/s")
    for config, tok_s in (("float32", 40.0), ("int4-wo-g32", 90.0)):
        decode.add("generate", config, shape, "decode", tok_s, "tok/s")
    quality = Recorder("quality", folder / "quality.jsonl", ["--quick"])
    for config, ppl in (("float32", 12.0), ("int4-wo-g32", 12.6), ("int4-wo-g32+hqq", 12.4)):
        quality.add("torchqkit", config, {"model": "tiny", "tokens": 128}, "perplexity", ppl, "")
    return folder


def test_plot_makes_png_files(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot command needs matplotlib (pip install 'torchqkit[bench]'); "
                                            "without it the command says so instead of plotting")
    results = _results(tmp_path / "results")
    assert main(["plot", "--results", str(results), "--out", str(tmp_path / "png")]) == 0
    made = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert made == ["decode.png", "kernels.png", "quality.png"]
    assert all((tmp_path / "png" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in made)


def test_report_prints_the_latest_run_per_case_as_markdown(tmp_path, capsys):
    results = _results(tmp_path / "results")
    newer = [dict(r, value=r["value"] * 2, date="2999-01-01T00:00:00+00:00") for r in read_records(results /
                                                                                                 "quality.jsonl")]
    with open(results / "quality.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in newer))
    assert main(["report", "--results", str(results), "--groups", "quality"]) == 0
    text = capsys.readouterr().out
    assert "| case | config | shape | perplexity |" in text
    assert "| torchqkit | int4-wo-g32 | model=tiny tokens=128 | 25.2 |" in text and "12.6" not in text
