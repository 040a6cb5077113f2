"""quantize_ beyond nn.Linear (Note [Weight-bearing modules]): GPT-2's Conv1D (weight stored (in, out)), 1x1
convolutions served as a Linear on the channel dim, standalone embeddings (``embeddings=`` or named), and the
convolutions no path serves, reported with the reason or refused with strict=True before anything changes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchqkit as qk

from ..common import dequantized_copy, small_hf_llama



# ----------------------------------------------------------------------------------------- GPT-2 Conv1D

def test_gpt2_conv1d_quantized_along_in_and_served_through_the_transposed_view(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    float_c_fc = model.transformer.h[0].mlp.c_fc.weight.detach().clone()           # (in 64, out 256)
    report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
    convs = [e for e in report.entries if e.fqn.split(".")[-1] in ("c_attn", "c_proj", "c_fc")]
    assert len(convs) == 8 and all(e.status == "quantized" for e in convs)       # 2 layers x 4 Conv1D
    assert report["lm_head"].status == "kept"                                    # tied to wte, not named
    w = model.transformer.h[0].mlp.c_fc.weight
    assert isinstance(w, qk.AffineQuantizedTensor) and w.transposed and tuple(w.shape) == (64, 256)
    inner = w.t()                                                                # (out, in): groups along in
    assert tuple(inner.shape) == (256, 64) and inner.block_size == (1, 32)
    lin = nn.Linear(64, 256, bias=False)
    with torch.no_grad():
        lin.weight.copy_(float_c_fc.t())
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=32))
    assert torch.equal(inner.dequantize(), lin.weight.dequantize())             # the same codes as W^T quantized
    ids = torch.tensor([[1, 5, 9, 127, 0, 64]])
    ref = dequantized_copy(model)
    with torch.no_grad():
        logits, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # the transposed view is what the checkpoint holds: a float GPT-2 loads it and computes the same logits
    path = tmp_path / "gpt2.safetensors"
    qk.save_quantized(model, path)
    loaded = transformers.GPT2LMHeadModel(config).eval()
    qk.load_quantized(loaded, path)
    assert loaded.transformer.h[1].attn.c_attn.weight.transposed
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


# -------------------------------------------------------------------------------------------- convolutions

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pw1 = nn.Conv2d(32, 64, 1)
        self.pw2 = nn.Conv2d(64, 32, 1, stride=2, padding=1, bias=False)
        self.k3 = nn.Conv2d(32, 32, 3, padding=1)
        self.grouped = nn.Conv2d(32, 32, 1, groups=4)
        self.seq = nn.Conv1d(32, 64, 1, stride=2)

    def forward(self, x):
        x = self.k3(self.pw2(torch.relu(self.pw1(x))))
        x = self.grouped(x)
        return self.seq(x.flatten(2))


def _convs(module, fqn):
    return isinstance(module, (nn.Conv1d, nn.Conv2d))


def test_1x1_convolutions_run_as_quantized_linears_and_the_others_are_reported():
    torch.manual_seed(0)
    model = ConvNet().eval()
    with pytest.warns(UserWarning, match="2 selected layer"):
        report = qk.quantize_(model, qk.Int8WeightOnlyConfig(), filter_fn=_convs)
    assert [e.status for e in report.entries] == ["quantized", "quantized", "skipped", "skipped", "quantized"]
    assert "kernel_size (3, 3): torchqkit serves 1x1 convolutions only" in report["k3"].reason
    assert "groups=4" in report["grouped"].reason
    assert report["pw1"].bytes_before == 64 * 32 * 4 and report["pw1"].bytes_after == 64 * 32 + 64 * 4
    assert tuple(model.pw1.weight.shape) == (64, 32) and model.pw1.weight.qdtype is qk.qdtypes.int8
    x = torch.randn(2, 32, 7, 9, generator=torch.Generator().manual_seed(1))
    ref = dequantized_copy(model)
    with torch.no_grad():
        out, want = model(x), ref(x)
    assert out.shape == want.shape == (2, 64, 15)  # 7 x 9 -> 5 x 6 (stride 2, padding 1) -> 30 -> 15
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # The quantized 1x1 weight is 2-d, (out, in): its state dict loads into a model quantized the same way
    again = ConvNet().eval()
    with pytest.warns(UserWarning, match="2 selected layer"):
        qk.quantize_(again, qk.Int8WeightOnlyConfig(), filter_fn=_convs)
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(again(x), out)


def test_a_quantized_1x1_convolution_loads_into_a_float_or_meta_model(tmp_path):
    # save_quantized stores the 1x1 weight 2-d; load_quantized puts it into the model's (out, in, 1, 1) conv
    torch.manual_seed(0)
    model = ConvNet().eval()
    with pytest.warns(UserWarning, match="2 selected layer"):
        qk.quantize_(model, qk.Int8WeightOnlyConfig(), filter_fn=_convs)
    path = tmp_path / "convnet.safetensors"
    qk.save_quantized(model, path)
    x = torch.randn(2, 32, 7, 9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    for device in ("cpu", "meta"):
        with torch.device(device):
            fresh = ConvNet().eval()
        qk.load_quantized(fresh, path)
        assert isinstance(fresh.pw1.weight, qk.AffineQuantizedTensor) and tuple(fresh.pw1.weight.shape) == (64, 32)
        with torch.no_grad():
            assert torch.equal(fresh(x), want)
    # a 3x3 conv's weight is not a 1x1 one: the shape mismatch is still refused
    with pytest.raises(qk.CheckpointError, match=r"'pw1.weight' has shape \[64, 32\], the model's is \[64, 32, 3, 3\]"):
        broken = ConvNet().eval()
        broken.pw1 = nn.Conv2d(32, 64, 3)
        qk.load_quantized(broken, path)


def test_strict_refuses_unserved_convolutions_before_anything_changes():
    model = ConvNet().eval()
    before = {name: p for name, p in model.named_parameters()}
    with pytest.raises(qk.QuantizationError, match=r"k3: Conv2d with kernel_size \(3, 3\).*grouped: Conv2d with "
                                                   r"groups=4"):
        qk.quantize_(model, qk.Int8WeightOnlyConfig(), filter_fn=_convs, strict=True)
    assert all(p is before[name] and not isinstance(p, qk.AffineQuantizedTensor)
               for name, p in model.named_parameters())


def test_convolutions_are_not_selected_by_default():
    model = ConvNet().eval()
    assert len(qk.quantize_(model, qk.Int8WeightOnlyConfig())) == 0
    report = qk.quantize_(model, qk.ModuleConfigs({"pw1": qk.Int8WeightOnlyConfig()}))  # named: quantized
    assert [e.fqn for e in report.quantized] == ["pw1"]


# -------------------------------------------------------------------------------------------- embeddings

class EmbedModel(nn.Module):
    """A standalone embedding of SmolLM2's width (576) with a small vocabulary, and an untied output layer."""

    def __init__(self, vocab=512, dim=576):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.emb(ids))


@pytest.fixture
def dequantized_shapes(monkeypatch):
    shapes, original = [], qk.AffineQuantizedTensor.dequantize

    def spy(self, *args, **kwargs):
        shapes.append(tuple(self.shape))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(qk.AffineQuantizedTensor, "dequantize", spy)
    return shapes


def test_standalone_embedding_with_embeddings_argument_gathers_only_its_rows(dequantized_shapes):
    torch.manual_seed(0)
    model = EmbedModel().eval()
    float_emb = model.emb.weight.detach().clone()
    report = qk.quantize_(model, qk.Int8WeightOnlyConfig(), embeddings=qk.Int4WeightOnlyConfig(group_size=32))
    assert [(e.fqn, e.status, e.config) for e in report.entries] == [
        ("emb", "quantized", "int4 weight-only g32"), ("head", "quantized", "int8 weight-only per-channel")]
    assert report["emb"].bytes_before == 512 * 576 * 4
    w = model.emb.weight
    ids = torch.tensor([[7, 3, 511, 7], [0, 3, 100, 200]])
    full = w.dequantize()
    dequantized_shapes.clear()
    with torch.no_grad():
        rows = model.emb(ids)
    assert (512, 576) not in dequantized_shapes and dequantized_shapes    # never the whole table
    assert torch.equal(rows, F.embedding(ids, full))
    assert (rows - F.embedding(ids, float_emb)).abs().max() < 0.2 * float_emb.abs().max()  # int4 g32 error


def test_embedding_named_in_module_configs_and_left_alone_by_default():
    model = EmbedModel().eval()
    report = qk.quantize_(model, qk.Int8WeightOnlyConfig())
    assert [e.fqn for e in report.entries] == ["head"] and not isinstance(model.emb.weight, qk.AffineQuantizedTensor)
    model = EmbedModel().eval()
    report = qk.quantize_(model, qk.ModuleConfigs({"emb": qk.Int8WeightOnlyConfig(group_size=64), "head": None}))
    assert report["emb"].status == "quantized" and model.emb.weight.block_size == (1, 64)


def test_embeddings_argument_leaves_a_tied_embedding_to_its_output_layer():
    pytest.importorskip("transformers")
    model = small_hf_llama()
    report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32), embeddings=qk.Int8WeightOnlyConfig())
    assert report["lm_head"].status == "kept" and "tied to model.embed_tokens.weight" in report["lm_head"].reason
    assert not isinstance(model.model.embed_tokens.weight, qk.AffineQuantizedTensor)


def test_bad_embedding_inputs():
    with pytest.raises(TypeError, match=r"quantize_\(embeddings=...\) takes a QuantConfig .* got str"):
        qk.quantize_(EmbedModel(), qk.Int8WeightOnlyConfig(), embeddings="int8-wo")
    model = EmbedModel()
    model.emb.max_norm = 1.0
    with pytest.raises(qk.QuantizationError, match="emb: nn.Embedding with max_norm=1.0 renormalizes its rows"):
        qk.quantize_(model, qk.Int8WeightOnlyConfig(), embeddings=qk.Int8WeightOnlyConfig(), strict=True)
    assert not isinstance(model.head.weight, qk.AffineQuantizedTensor)


def test_a_tied_embedding_named_in_module_configs_takes_its_output_layer_along():
    pytest.importorskip("transformers")
    model = small_hf_llama()
    report = qk.quantize_(model, qk.ModuleConfigs({"model.embed_tokens": qk.Int8WeightOnlyConfig(), "lm_head": None,
                                                   "_default": qk.Int4WeightOnlyConfig(group_size=32)}))
    assert report["model.embed_tokens"].status == "quantized"
    assert report["lm_head"].status == "shared" and "its own config (None) was not applied" in report["lm_head"].reason
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.qdtype is qk.qdtypes.int8


def test_a_quantized_1x1_convolution_compiles_to_the_eager_result():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(32, 64, 1), nn.ReLU(), nn.Conv2d(64, 32, 1, stride=2, padding=1)).eval()
    qk.quantize_(model, qk.Int8WeightOnlyConfig(), filter_fn=_convs)
    x = torch.randn(2, 32, 7, 9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager, compiled = model(x), torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


def test_a_tied_embedding_selected_but_not_named_follows_its_named_output_layer():
    pytest.importorskip("transformers")
    model = small_hf_llama()
    configs = qk.ModuleConfigs({"lm_head": qk.Int8WeightOnlyConfig(),
                                "_default": qk.Int4WeightOnlyConfig(group_size=32)})
    with pytest.warns(UserWarning, match="left unquantized"):  # the norms and rotary modules a filter of all selects
        report = qk.quantize_(model, configs, filter_fn=lambda module, fqn: True)
    assert report["lm_head"].status == "quantized" and report["lm_head"].config == "int8 weight-only per-channel"
    assert report["model.embed_tokens"].status == "shared"
    assert report["model.embed_tokens"].shared_with == "lm_head.weight"
    assert model.lm_head.weight is model.model.embed_tokens.weight
