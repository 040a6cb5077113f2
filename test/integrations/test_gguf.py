"""from_gguf: GGUF block formats decoded bit for bit into layouts, a tiny LLaMA GGUF against transformers' own
(dequantizing) loader, and the errors for files it can't import."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torchqkit as qk
from torchqkit.core.primitives import dequantize_affine
from torchqkit.integrations.gguf_blocks import BLOCK_FORMATS, decode_blocks

from .tiny_gguf import HIDDEN, RAW_BLOCK_F16, VOCAB, write_tiny_llama

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
T = gguf.GGMLQuantizationType
F16_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], **RAW_BLOCK_F16}


def _random_blocks(name, rows, k, seed=0):
    """Any bytes are valid blocks once the fp16 scales are finite: every code, nibble and sub-scale pattern."""
    fmt = BLOCK_FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // fmt.block, fmt.block_bytes), dtype=np.uint8)
    for at in F16_OFFSETS[name]:
        scale = (rng.standard_normal((rows, k // fmt.block)) * 0.1).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(BLOCK_FORMATS))
def test_decoded_blocks_equal_gguf_dequantization(name):
    rows, k = 6, 512
    raw = _random_blocks(name, rows, k)
    fmt, parts = decode_blocks(BLOCK_FORMATS[name], torch.from_numpy(raw), k)
    ours = dequantize_affine(parts.qdata, fmt.qdtype, (1, fmt.group), parts.scale, parts.zero_point,
                             zero_point_domain=fmt.zero_point_domain)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, getattr(T, name))).reshape(rows, k)
    # Same codes, same scales: at most one float32 rounding apart ((q - mid) s + z here, q s + m there).
    torch.testing.assert_close(ours, ref, rtol=2e-7, atol=1e-7 * float(ref.abs().max()))
    assert parts.qdata.min() >= fmt.qdtype.qmin and parts.qdata.max() <= fmt.qdtype.qmax


def test_q3_k_negative_sub_scales_fold_into_int3_codes():
    raw = _random_blocks("Q3_K", 4, 256, seed=4).reshape(4, 1, 110)
    raw[..., 0:32] = 0xFF  # every high bit set: codes 0..3, never -4
    raw[..., 96:108] = 0x00  # every 6-bit scale 0: d (0 - 32), negative
    raw = raw.reshape(4, -1)
    fmt, parts = decode_blocks(BLOCK_FORMATS["Q3_K"], torch.from_numpy(raw), 256)
    assert fmt.qdtype is qk.qdtypes.int3 and bool((parts.scale >= 0).all())
    ours = dequantize_affine(parts.qdata, fmt.qdtype, (1, 16), parts.scale)
    torch.testing.assert_close(ours, torch.from_numpy(gguf.quants.dequantize(raw, T.Q3_K)).reshape(4, 256))


def test_q6_k_negative_sub_scales_fold_into_int6_codes():
    raw = _random_blocks("Q6_K", 4, 256, seed=3).reshape(4, 1, 210)
    raw[..., 0:192] = 0x11  # codes 1 + 16 + ... never -32: every group's sign can move into its codes
    raw[..., 192:208] = np.array([-3, 5] * 8, dtype=np.int8).view(np.uint8)
    raw = raw.reshape(4, -1)
    fmt, parts = decode_blocks(BLOCK_FORMATS["Q6_K"], torch.from_numpy(raw), 256)
    assert fmt.qdtype is qk.qdtypes.int6 and bool((parts.scale >= 0).all())
    ours = dequantize_affine(parts.qdata, fmt.qdtype, (1, 16), parts.scale)
    torch.testing.assert_close(ours, torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K)).reshape(4, 256))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
    return path, reference.eval()


def _logits(model, seed=0):
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_tiny_llama_imports_every_linear_as_stored(tiny):
    path, reference = tiny
    model = qk.from_gguf(path)
    report = model.torchqkit_report
    formats = {e.fqn: e.config for e in report.quantized}
    assert len(formats) == 14  # 14 Linears, one stored as F16 stays float, and the Q8_0 embedding
    assert "gguf Q4_K -> uint4 g32" in formats["model.layers.0.mlp.down_proj"]
    assert "gguf Q8_0 -> int8 g32" in formats["model.layers.0.self_attn.v_proj"]
    assert not isinstance(model.model.layers[1].mlp.up_proj.weight, qk.AffineQuantizedTensor)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, qk.AffineQuantizedTensor)
    # The Q8_0 embedding stays quantized and the tied lm_head reads that same weight.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.lm_head.weight, qk.AffineQuantizedTensor)
    assert model.model.embed_tokens.weight.shape == (VOCAB, HIDDEN)
    assert "gguf Q8_0 -> int8 g32" in formats["model.embed_tokens"]
    assert "int8" in repr(model.model.layers[0].self_attn.v_proj)
    ours, ref = _logits(model), _logits(reference)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("name, stored", [("Q5_K", "uint5 g32"), ("Q2_K", "uint2 g16"), ("Q3_K", "int8 g16")])
def test_more_k_quants_import_as_stored(tmp_path, name, stored):
    """Random Q3_K bytes hold negative sub-scales next to -4 codes: such a tensor keeps int8 codes."""
    path = write_tiny_llama(tmp_path / "k.gguf", down_format_override=name, seed=2)
    model = qk.from_gguf(path)
    assert f"gguf {name} -> {stored}" in model.torchqkit_report["model.layers.0.mlp.down_proj"].config
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref = _logits(reference)
    torch.testing.assert_close(_logits(model), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_unsupported_types_are_dequantized_with_a_warning(tmp_path):
    path = write_tiny_llama(tmp_path / "iq4.gguf", down_format_override="IQ4_NL", seed=1)
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp\.down_proj\.weight \(IQ4_NL"):
        model = qk.from_gguf(path)
    assert not isinstance(model.model.layers[0].mlp.down_proj.weight, qk.AffineQuantizedTensor)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref = _logits(reference)
    torch.testing.assert_close(_logits(model), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_save_pretrained_round_trip(tiny, tmp_path):
    model = qk.from_gguf(tiny[0])
    qk.save_pretrained(model, tmp_path / "out")
    again = qk.from_pretrained(tmp_path / "out")
    assert torch.equal(_logits(again), _logits(model))


def test_bad_files_raise_before_loading(tmp_path):
    with pytest.raises(qk.GGUFError, match="No such file"):
        qk.from_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(qk.GGUFError, match="not a readable GGUF file"):
        qk.from_gguf(junk)
    other = write_tiny_llama(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(qk.GGUFError, match="architecture 'gpt2' is not supported"):
        qk.from_gguf(other)
