"""torchqkit.eval.greedy_decode / LeanDecoder: the same tokens as transformers' greedy generate(), eager and
compiled (one graph calling torchqkit's custom ops), on a tiny seeded LLaMA with a quantized tied lm_head."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.eval import LeanDecoder, greedy_decode

from .models import tiny_llama

pytest.importorskip("transformers")

PROMPT = torch.tensor([3, 14, 15, 92, 65, 35])
NEW = 12


def generate_reference(model, new_tokens=NEW):
    """HF greedy generate() that never stops early: the tokens the lean loop must reproduce."""
    ids = PROMPT.unsqueeze(0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=new_tokens,
                              max_new_tokens=new_tokens, pad_token_id=0)


def int4_with_tied_head(model):
    config = qk.Int4WeightOnlyConfig(group_size=32)
    report = qk.quantize_(model, qk.ModuleConfigs({"lm_head": config, "_default": config}))
    assert len(report.quantized) == 15  # 2 layers x 7 Linears + the lm_head
    assert model.lm_head.weight is model.model.embed_tokens.weight   # still tied
    return model


def test_eager_lean_decode_equals_generate():
    model = tiny_llama(96)
    expected = generate_reference(model)
    out = greedy_decode(model, PROMPT, NEW)
    assert out.shape == (1, PROMPT.numel() + NEW)
    assert out.tolist() == expected.tolist()


def test_compiled_lean_decode_calls_custom_ops_and_equals_generate():
    from torch._inductor.utils import run_and_get_code

    model = int4_with_tied_head(tiny_llama(96))
    expected = generate_reference(model)[0, PROMPT.numel():]
    decoder = LeanDecoder(model, max_length=PROMPT.numel() + NEW, compile=True)
    first, code = run_and_get_code(decoder.generate, PROMPT, NEW)
    assert first.tolist() == expected.tolist()
    assert decoder.compile_seconds is not None and decoder.compile_seconds > 0
    # fullgraph=True: one graph; its 15 quantized linears are calls of the int4 op, not dequantize + mm.
    step_code = "\n".join(code)
    assert step_code.count("torchqkit.linear_int4wo_tiled") >= 15
    assert "extern_kernels.mm(" not in step_code and "extern_kernels.addmm(" not in step_code
    # A second prompt reuses the compiled step (skipping guards after its first step) and still matches.
    again = decoder.generate(PROMPT, NEW)
    assert again.tolist() == expected.tolist()


def test_changed_model_recompiles_instead_of_running_a_stale_graph():
    model = tiny_llama(96)
    decoder = LeanDecoder(model, max_length=PROMPT.numel() + 6, compile=True)
    decoder.generate(PROMPT, 6)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)     # same tensors, new values: the graph reads them, tokens change
    expected = generate_reference(model, 6)[0, PROMPT.numel():]
    assert decoder.generate(PROMPT, 6).tolist() == expected.tolist()
    int4_with_tied_head(model)            # new weight objects of another type: dynamo's guards recompile
    expected = generate_reference(model, 6)[0, PROMPT.numel():]
    assert decoder.generate(PROMPT, 6).tolist() == expected.tolist()


def test_rejects_what_it_cannot_decode():
    model = tiny_llama(96)
    decoder = LeanDecoder(model, max_length=10)
    with pytest.raises(ValueError, match="needs 11 cache positions; this LeanDecoder holds max_length=10"):
        decoder.generate(PROMPT, 5)
    with pytest.raises(ValueError, match="new_tokens must be a positive int"):
        decoder.generate(PROMPT, 0)
    with pytest.raises(ValueError, match="inductor_options are for the compiled step"):
        LeanDecoder(model, 10, inductor_options={"cpp_wrapper": True})
    with pytest.raises(TypeError, match="Embedding has no `config`.*decode='generate'"):
        LeanDecoder(nn.Embedding(20, 20), 10)
