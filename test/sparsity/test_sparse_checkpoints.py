"""2:4 sparse checkpoints: torchqkit's safetensors files and transformers' save_pretrained / from_pretrained bring a
2:4 + int4 tiny LLaMA back with identical packed tensors and logits; torch.compile and weights-only torch.load too."""
from __future__ import annotations

import io
import os

import pytest
import torch

import torchqkit as qk

from ..common import one_torch_thread, small_hf_llama  # noqa: F401  (one_torch_thread: autouse)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: before transformers
transformers = pytest.importorskip("transformers")

IDS = torch.arange(24).reshape(2, 12) * 7 % 128
BATCHES = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
CONFIG = qk.SparsityConfig(pattern=(2, 4), method="sparsegpt", base=qk.Int4WeightOnlyConfig(group_size=32))


@pytest.fixture(scope="module")
def pruned():
    model = small_hf_llama().eval()
    qk.quantize_(model, CONFIG, calibration_data=BATCHES, strict=True)
    return model


def _same_weights(a, b) -> None:
    wa, wb = a.state_dict(), b.state_dict()
    assert wa.keys() == wb.keys()
    for name, t in wa.items():
        other = wb[name]
        if isinstance(t, qk.AffineQuantizedTensor):
            assert isinstance(other, qk.AffineQuantizedTensor) and other.attributes() == t.attributes(), name
            for inner, x in t.inner_tensors().items():
                y = other.inner_tensors()[inner]
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (name, inner)
        else:
            assert torch.equal(t, other), name


@torch.no_grad()
def test_safetensors_round_trip_is_exact(pruned, tmp_path):
    path = tmp_path / "sparse.safetensors"
    qk.save_quantized(pruned, path, config=CONFIG)
    fresh = qk.load_quantized(small_hf_llama(seed=1).eval(), path)
    _same_weights(pruned, fresh)
    assert torch.equal(fresh(IDS).logits, pruned(IDS).logits)
    assert isinstance(fresh.model.layers[0].mlp.down_proj.weight.qlayout, qk.NMSparseLayout)


@torch.no_grad()
def test_transformers_save_pretrained_from_pretrained_is_exact(pruned, tmp_path):
    expected = pruned(IDS).logits
    pruned.save_pretrained(tmp_path / "hf")
    for loader in (transformers.AutoModelForCausalLM.from_pretrained, qk.from_pretrained):
        loaded = loader(tmp_path / "hf").eval()
        _same_weights(pruned, loaded)
        assert torch.equal(loaded(IDS).logits, expected), loader


@torch.no_grad()
def test_weights_only_torch_load_and_compile(pruned):
    buf = io.BytesIO()
    torch.save(pruned.state_dict(), buf)
    buf.seek(0)
    model = small_hf_llama(seed=1).eval()
    model.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    _same_weights(pruned, model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # what inductor gets, without codegen
    torch.testing.assert_close(compiled(IDS).logits, pruned(IDS).logits, rtol=1e-5, atol=1e-5)
