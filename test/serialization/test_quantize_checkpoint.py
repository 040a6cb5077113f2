"""quantize_checkpoint and `python -m torchqkit quantize`: float safetensors in, torchqkit checkpoint out,
equal to quantize_ on the loaded float model."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from torch import nn

import torchqkit as qk
from torchqkit.cli import main as cli_main
from torchqkit.serialization import read_checkpoint_info

from ..common import make_model, model_input

CONFIGS = qk.ModuleConfigs({
    "lm_head": None,
    r"re:layers\.\d+\.mlp\..*": qk.Int4WeightOnlyConfig(group_size=32),
    "_default": qk.Int8DynamicActivationInt8WeightConfig(),
})


class WithEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(50, 32)
        self.proj = nn.Linear(32, 32)
        self.odd = nn.Linear(32, 30)

    def forward(self, ids):
        return self.odd(self.proj(self.tok_embeddings(ids)))


@pytest.fixture(scope="module")
def float_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "float.safetensors"
    safetensors.torch.save_file(make_model("transformer").state_dict(), path)  # written by safetensors itself
    return path


def _meta_transformer():
    with torch.device("meta"):
        return make_model("transformer")


def test_equals_quantize_on_the_float_model(float_file, tmp_path, capsys):
    report = qk.quantize_checkpoint(float_file, tmp_path / "q.safetensors", CONFIGS, progress=True)
    assert len(report.quantized) == 14 and report["lm_head"].status == "kept"
    assert report["layers.0.mlp.up_proj"].config == "int4 weight-only g32"
    progress = capsys.readouterr().err
    assert "25/25 tensors" in progress and "lm_head.weight" in progress
    reference = make_model("transformer")
    qk.quantize_(reference, CONFIGS)
    loaded = qk.load_quantized(_meta_transformer(), tmp_path / "q.safetensors")
    x = model_input("transformer")
    assert torch.equal(loaded(x), reference(x))
    assert read_checkpoint_info(tmp_path / "q.safetensors")["config"] == CONFIGS


def test_sharded_input_and_output(float_file, tmp_path):
    state = safetensors.torch.load_file(float_file)
    names = sorted(state)
    halves = {"a.safetensors": names[:10], "b.safetensors": names[10:]}
    for fname, part in halves.items():
        safetensors.torch.save_file({n: state[n] for n in part}, tmp_path / fname)
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out" / "model.safetensors"
    qk.quantize_checkpoint(tmp_path, out, CONFIGS, max_shard_bytes=100_000, progress=False)
    shards = sorted(p.name for p in out.parent.iterdir())
    assert shards[-1] == "model.safetensors.index.json" and len(shards) > 3
    assert not any(".part" in s or s.endswith(".data") for s in shards)  # no temporaries left behind
    loaded = qk.load_quantized(_meta_transformer(), out.parent)
    reference = make_model("transformer")
    qk.quantize_(reference, CONFIGS)
    x = model_input("transformer")
    assert torch.equal(loaded(x), reference(x))


def test_embeddings_are_not_taken_for_linears_and_a_skeleton_decides(tmp_path):
    torch.manual_seed(0)
    model = WithEmbedding()
    safetensors.torch.save_file(model.state_dict(), tmp_path / "f.safetensors")
    report = qk.quantize_checkpoint(tmp_path / "f.safetensors", tmp_path / "q.safetensors", qk.Int8WeightOnlyConfig(),
                                    progress=False)
    assert sorted(e.fqn for e in report.quantized) == ["odd", "proj"]
    with torch.device("meta"):
        skeleton = WithEmbedding()
    skeleton.proj = nn.Identity()  # the skeleton, not the names, says what is a Linear
    report = qk.quantize_checkpoint(tmp_path / "f.safetensors", tmp_path / "q2.safetensors", qk.Int8WeightOnlyConfig(),
                                    model=skeleton, progress=False)
    assert [e.fqn for e in report.quantized] == ["odd"]


def test_unquantizable_weight_is_kept_and_reported_or_strict_raises(tmp_path):
    poisoned = torch.randn(16, 48)  # 48: a partial group of 64, fine; the NaN is what can't be quantized
    poisoned[3, 7] = float("nan")
    safetensors.torch.save_file({"a.weight": poisoned, "b.weight": torch.randn(16, 64)}, tmp_path / "f.safetensors")
    config = qk.Int4WeightOnlyConfig(group_size=64)
    report = qk.quantize_checkpoint(tmp_path / "f.safetensors", tmp_path / "q.safetensors", config, progress=False)
    assert report["a"].status == "skipped" and "NaN" in report["a"].reason and report["b"].status == "quantized"
    stored = safetensors.torch.load_file(tmp_path / "q.safetensors")
    assert "a.weight" in stored and "b.weight:qdata" in stored
    with pytest.raises(qk.QuantizationError, match="a: "):
        qk.quantize_checkpoint(tmp_path / "f.safetensors", tmp_path / "strict.safetensors", config, strict=True,
                               progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors", "q.safetensors"]


def test_refuses_an_already_quantized_checkpoint(float_file, tmp_path):
    qk.quantize_checkpoint(float_file, tmp_path / "q.safetensors", CONFIGS, progress=False)
    with pytest.raises(qk.CheckpointError, match="already quantized"):
        qk.quantize_checkpoint(tmp_path / "q.safetensors", tmp_path / "qq.safetensors", CONFIGS, progress=False)


def test_cli(float_file, tmp_path, capsys):
    CONFIGS.to_json(tmp_path / "quant.json")
    assert cli_main(["quantize", str(float_file), str(tmp_path / "q.safetensors"), "--config",
                     str(tmp_path / "quant.json"), "--quiet"]) == 0
    out = capsys.readouterr()
    assert "14 quantized, 0 skipped, 1 kept" in out.out and out.err == ""
    assert read_checkpoint_info(tmp_path / "q.safetensors")["config"] == CONFIGS
    assert cli_main(["quantize", str(float_file), str(tmp_path / "n.safetensors"), "--config", "nf4-b64"]) == 0
    assert capsys.readouterr().err == ""  # stderr is captured, not a terminal: no progress bar
    assert read_checkpoint_info(tmp_path / "n.safetensors")["config"] == qk.NF4WeightOnlyConfig(block_size=64)
    with pytest.raises(SystemExit):
        cli_main(["quantize", str(float_file), str(tmp_path / "x.safetensors"), "--config", "int3-magic"])
    assert "neither a preset name" in capsys.readouterr().err
