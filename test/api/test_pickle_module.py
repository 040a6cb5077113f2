"""torch.save(model) of a whole quantized module (pickled, not a state dict) loads back with
torch.load(weights_only=False) to equal outputs, for every demo config, for a tied quantized embedding, and
for a model filled by load_quantized; print(model) still names each quantized weight's format."""
from __future__ import annotations

import io

import pytest
import torch

import torchqkit as qk
from torchqkit.demo import DEMO_CONFIGS

from ..common import make_model, model_input
from ..serialization.models import meta_model, quantized_model
from ..serialization.models import model_input as ids_input
from .test_ties import IDS, _tied


def _pickled(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", list(DEMO_CONFIGS))
def test_whole_quantized_module_round_trips(name):
    model = make_model("transformer")
    report = qk.quantize_(model, DEMO_CONFIGS[name](), strict=True)
    assert report.quantized
    loaded = _pickled(model)
    x = model_input("transformer")
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    w = loaded.layers[0].mlp.up_proj.weight
    assert isinstance(w, qk.AffineQuantizedTensor) and w.attributes() == model.layers[0].mlp.up_proj.weight.attributes()
    text = repr(loaded.layers[0].mlp.up_proj)
    assert f"weight={w.qdtype.name}" in text and repr(w.qlayout) in text


def test_tied_quantized_embedding_stays_tied_through_pickle():
    model = _tied()
    qk.quantize_(model, qk.ModuleConfigs({"head": qk.Int8WeightOnlyConfig(), "_default": qk.Int8WeightOnlyConfig()}),
                 strict=True)
    loaded = _pickled(model)
    assert loaded.head.weight is loaded.embed.weight and loaded.a.weight is loaded.b.weight
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))
    assert "weight=int8" in repr(loaded.embed)


def test_model_filled_by_load_quantized_round_trips(tmp_path):
    model = quantized_model()
    qk.save_quantized(model, tmp_path / "m.safetensors")
    fresh = qk.load_quantized(meta_model(), tmp_path / "m.safetensors")
    loaded = _pickled(fresh)
    x = ids_input()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert "PlainLayout()" in repr(loaded.blocks["int8_row"]) and "weight=" not in repr(loaded.blocks["kept"])
