"""transformers' own from_pretrained / save_pretrained through the "torchqkit" quantizer, on a tiny LLaMA:
quantizing while loading equals quantize_ on the float model (logits and report), checkpoints written by either
saver load with either loader to the same logits, shards that transformers cuts load too, and bad checkpoints
are refused before anything is loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchqkit as qk
from test.common import small_hf_llama
from torchqkit.serialization.safetensors_file import CheckpointError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: before transformers
transformers = pytest.importorskip("transformers")

IDS = torch.arange(24).reshape(2, 12) * 5 % 128
MIXED = {"lm_head": qk.Int8WeightOnlyConfig(), r"re:.*\.mlp\..*": qk.NF4WeightOnlyConfig(block_size=32),
         "model.layers.1.self_attn.o_proj": None, "_default": qk.Int4WeightOnlyConfig(group_size=32)}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    model = small_hf_llama()
    path = tmp_path_factory.mktemp("float")
    model.save_pretrained(path)
    return path


def _float(float_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(float_dir).eval()


def _quantized_on_load(float_dir, config, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=qk.TorchqkitConfig(config), **kwargs).eval()


@pytest.mark.parametrize("config", [qk.Int4WeightOnlyConfig(group_size=32), qk.ModuleConfigs(MIXED),
                                    qk.Int8DynamicActivationInt8WeightConfig()], ids=["int4", "mixed", "int8dyn"])
@torch.no_grad()
def test_quantize_on_load_equals_quantize_(float_dir, config):
    ref = _float(float_dir)
    report = qk.quantize_(ref, config)
    model = _quantized_on_load(float_dir, config, device_map="cpu")
    assert str(model.torchqkit_report) == str(report)
    assert torch.equal(model(IDS).logits, ref(IDS).logits)
    for fqn, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert isinstance(m.weight, qk.AffineQuantizedTensor) == (report[fqn].status in ("quantized", "shared"))
    named_head = isinstance(config, qk.ModuleConfigs)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives, quantized or not
    assert isinstance(model.lm_head.weight, qk.AffineQuantizedTensor) == named_head
    assert "weight=" in repr(model.model.layers[0].self_attn.q_proj)


@torch.no_grad()
def test_saved_by_either_loads_with_either(float_dir, tmp_path):
    config = qk.ModuleConfigs(MIXED)
    model = _quantized_on_load(float_dir, config)
    expected = model(IDS).logits
    model.save_pretrained(tmp_path / "hf")
    qc = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torchqkit" and qc["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert qc["modules_not_to_convert"] == ["model.layers.1.self_attn.o_proj"]
    assert qk.ModuleConfigs(qc["config"]["module_configs"]) == config
    qk.save_pretrained(model, tmp_path / "qk", config=config)
    for saved in ("hf", "qk"):
        for load in (transformers.AutoModelForCausalLM.from_pretrained, qk.from_pretrained):
            loaded = load(tmp_path / saved)
            assert torch.equal(loaded(IDS).logits, expected), (saved, load)
            assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
            assert isinstance(loaded.model.layers[0].mlp.up_proj.weight, qk.AffineQuantizedTensor)
    # A reloaded model saves again, to the same tensors and header (the config's pattern order included).
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    again.save_pretrained(tmp_path / "again")
    assert _contents(tmp_path / "again") == _contents(tmp_path / "hf")


def _contents(directory):
    from safetensors import safe_open
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["torchqkit"])
        assert len(header.pop("save_id")) == 8  # new for every save (Note [Shard headers]); the rest is equal
        return header, list(header["config"]["module_configs"]), {k: f.get_tensor(k).view(-1).view(torch.uint8).tolist()
                                                                  for k in f.keys()}


@torch.no_grad()
def test_whole_model_pickles(float_dir, tmp_path):
    """torch.save(model) keeps working on models transformers loaded through the quantizer (model.hf_quantizer
    holds no open file)."""
    import io
    model = _quantized_on_load(float_dir, qk.Int4WeightOnlyConfig(group_size=32))
    model.save_pretrained(tmp_path)
    for m in (model, transformers.AutoModelForCausalLM.from_pretrained(tmp_path)):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=False)(IDS).logits, m(IDS).logits)


@torch.no_grad()
def test_transformers_shards_load_with_both(float_dir, tmp_path):
    """transformers writes one whole-model header into every shard and may split a weight's tensors."""
    model = _quantized_on_load(float_dir, qk.Int4WeightOnlyConfig(group_size=32))
    expected = model(IDS).logits
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    for load in (transformers.AutoModelForCausalLM.from_pretrained, qk.from_pretrained):
        assert torch.equal(load(tmp_path)(IDS).logits, expected)


@torch.no_grad()
def test_generate_and_compile(float_dir):
    model = _quantized_on_load(float_dir, qk.Int4WeightOnlyConfig(group_size=32))
    eager = model(IDS).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(IDS).logits, eager, rtol=1e-5, atol=1e-5)
    out = model.generate(IDS[:1, :4], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 10)
    step = model(out[:, :-1]).logits[0, -1].argmax()  # greedy: the last token is the argmax of the step before
    assert int(step) == int(out[0, -1])


def _edit_header(path, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    header = json.loads(meta["torchqkit"])
    edit(header, meta)
    meta["torchqkit"] = json.dumps(header)
    save_file(tensors, str(path), metadata=meta)


def _bump_version(header, meta):
    header["format_version"] = 2
    meta["torchqkit_format"] = "2"


def _unknown_layout(header, meta):
    header["weights"]["model.layers.0.self_attn.q_proj.weight"]["layout"]["type"] = "hexagonal"


@pytest.mark.parametrize("edit, message", [(_bump_version, "upgrade torchqkit"),
                                           (_unknown_layout, "model.layers.0.self_attn.q_proj.weight")])
def test_bad_checkpoint_refused_before_loading(float_dir, tmp_path, edit, message):
    qk_model = _float(float_dir)
    qk.quantize_(qk_model, qk.Int4WeightOnlyConfig(group_size=32))
    qk.save_pretrained(qk_model, tmp_path)
    _edit_header(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=message) as e:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "model.safetensors" in str(e.value)


def test_config_checks(float_dir):
    with pytest.raises(ValueError, match="give the config to quantize with"):
        transformers.AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=qk.TorchqkitConfig())
    with pytest.raises(TypeError, match="QuantConfig or ModuleConfigs"):
        qk.TorchqkitConfig("int4")
    with pytest.raises(ValueError, match="GPTQConfig needs calibration data"):
        transformers.AutoModelForCausalLM.from_pretrained(
            float_dir, quantization_config=qk.TorchqkitConfig(qk.GPTQConfig(qk.Int4WeightOnlyConfig(group_size=32))))
    config = qk.TorchqkitConfig(qk.ModuleConfigs(MIXED))
    assert qk.TorchqkitConfig.from_dict(config.to_dict()) == config


def test_registered_only_when_transformers_quantizers_load():
    code = ("import sys, torchqkit; assert 'transformers' not in sys.modules; "
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M, AUTO_QUANTIZATION_CONFIG_MAPPING as C; "
            "assert M['torchqkit'].__name__ == 'TorchqkitHfQuantizer' and C['torchqkit'] is torchqkit.TorchqkitConfig")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_failed_registration_leaves_transformers_importable():
    """Registration runs inside transformers' import: if it fails (say a transformers without WeightConverter
    loading), transformers must still import, with a warning naming what won't work."""
    code = ("import sys, warnings; warnings.simplefilter('always'); import torchqkit; "
            "sys.modules['torchqkit.integrations.transformers_quantizer'] = None; "  # its import now fails
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M; assert 'torchqkit' not in M")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "could not register quant_method 'torchqkit'" in proc.stderr
