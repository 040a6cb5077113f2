"""The output layer at 8 bits: the body + output presets quantize a tied lm_head and its embedding once (one shared
weight), logits match the dequantized model, and the report notes a float weight that reads more bytes per token
than the quantized Linears (Note [Float reads per token])."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.api.float_reads import FLOAT_SHARE_NOTED

from ..common import dequantized_copy, small_hf_llama

pytest.importorskip("transformers")



def test_out8_quantizes_the_tied_weight_once_and_matches_the_dequantized_model():
    model = small_hf_llama()
    report = qk.quantize_(model, qk.presets.get("int4-wo-g32-out8"))
    head, emb = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is emb and isinstance(head, qk.AffineQuantizedTensor)        # one Parameter, still tied
    assert head.qdtype is qk.qdtypes.int8 and head.block_size == (1, 64)      # int8, one scale per row
    assert report["lm_head"].status == "quantized" and report["lm_head"].config == "int8 weight-only per-channel"
    assert report["lm_head"].bytes_after == 128 * 64 + 128 * 4                # codes + a float32 scale per row
    assert report["model.embed_tokens"].status == "shared" and report["model.embed_tokens"].bytes_after == 0
    assert report["model.layers.0.mlp.up_proj"].config == "int4 weight-only g32"
    assert report.notes == [] and "note:" not in str(report)
    ids = torch.tensor([[3, 17, 127, 0, 17, 64]])
    ref = dequantized_copy(model)
    with torch.no_grad():
        assert torch.equal(model.model.embed_tokens(ids), ref.model.embed_tokens(ids))  # the rows, exactly
        logits, expected = model(ids).logits, ref(ids).logits
    # kernels vs F.linear on the dequantized weights, float32: summation order only
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_gguf_like_mix_uses_q8_0_like_output_and_q4_1_like_body():
    model = small_hf_llama()
    report = qk.quantize_(model, qk.presets.get("gguf-q4_1-out-q8_0"))
    assert model.lm_head.weight.block_size == (1, 32) and model.lm_head.weight.qdtype is qk.qdtypes.int8
    assert report["lm_head"].bytes_after == 128 * 64 + 128 * 2 * 4             # int8 codes + a scale per 32
    body = model.model.layers[0].mlp.down_proj.weight
    assert body.qdtype is qk.qdtypes.uint4 and body.block_size == (1, 32)
    assert report["model.layers.0.mlp.down_proj"].config == "int4 weight-only g32, float16 scales"


def test_the_report_notes_a_float_tied_lm_head_that_outweighs_the_quantized_linears():
    model = small_hf_llama()
    report = qk.quantize_(model, qk.presets.get("int4-wo-g32"))
    assert report["lm_head"].status == "kept"
    quantized = sum(e.bytes_after for e in report.quantized)
    assert quantized == 64512 and 128 * 64 * 4 >= FLOAT_SHARE_NOTED * quantized    # 32768 of 64512 bytes
    note = ("lm_head (tied to model.embed_tokens) stays float32: 32.8 kB read per token, 0.5x all 14 quantized "
            "Linears together (64.5 kB); quantize it at 8 bits with the preset 'int4-wo-g32-out8' or "
            "ModuleConfigs({'lm_head': Int8WeightOnlyConfig(), '_default': Int4WeightOnlyConfig(...)})")
    assert report.notes == [note]
    assert str(report).endswith("\nnote: " + note)


def test_no_note_when_the_float_layers_are_small_next_to_the_quantized_ones():
    model = small_hf_llama()
    # int8 Linears read twice the int4 bytes: the float lm_head is then under half of them
    report = qk.quantize_(model, qk.Int8WeightOnlyConfig())
    assert report["lm_head"].status == "kept" and report.notes == []


def test_smollm2_sized_output_layer():
    """SmolLM2-135M's widths (vocab 49152, hidden 576, tied) with one decoder layer: the float32 lm_head is 113 MB."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    report = qk.quantize_(model, qk.presets.get("int4-wo-g32"))
    (note,) = report.notes
    assert note.startswith("lm_head (tied to model.embed_tokens) stays float32: 113.2 MB read per token, ")
    assert "x all 7 quantized Linears together" in note
    model = transformers.LlamaForCausalLM(config).eval()
    report = qk.quantize_(model, qk.presets.get("int4-wo-g32-out8"))
    assert report.notes == [] and model.lm_head.weight is model.model.embed_tokens.weight
    assert report["lm_head"].bytes_after == 49152 * 576 + 49152 * 4           # 28.5 MB instead of 113.2 MB
    ids = torch.tensor([[5, 49151, 1234, 5]])
    with torch.no_grad():
        rows = model.model.embed_tokens(ids)
    torch.testing.assert_close(rows, torch.nn.functional.embedding(ids, model.lm_head.weight.dequantize()),
                               rtol=0, atol=0)
