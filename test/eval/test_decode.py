"""torchqkit.eval.greedy_decode / LeanDecoder: the same tokens as transformers' greedy generate(), eager and
compiled (one graph calling torchqkit's custom ops), on a tiny seeded LLaMA with a quantized tied lm_head."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.eval import LeanDecoder, greedy_decode
from torchqkit.eval.step_replay import ReplayingInductor

from ..common import FLOAT_MM_CALLS, op_calls
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
    new = LeanDecoder(model, PROMPT.numel() + NEW).generate(PROMPT, NEW)   # decoded under inference mode
    assert not new.is_inference()
    new += 1                                                               # and the caller may modify the ids


def test_compiled_lean_decode_follows_the_model_and_calls_custom_ops():
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama(96)
    decoder = LeanDecoder(model, max_length=PROMPT.numel() + NEW, compile=True)
    tokens, code = run_and_get_code(decoder.generate, PROMPT, NEW)
    assert tokens.tolist() == generate_reference(model)[0, PROMPT.numel():].tolist()
    assert any(call in "\n".join(code) for call in FLOAT_MM_CALLS)  # the float linears, which the check below excludes
    assert decoder.compile_seconds is not None and decoder.compile_seconds > 0
    # Steps after the first call the inductor graph without dynamo (Note [Step replay]).
    assert (decoder.replayed_steps, decoder.replay_off, decoder.replay_calls) == (NEW - 2, None, "inductor")
    # Guards are skipped after each call's first step, never across calls: new values are read by the same
    # graph, new weight objects (quantized, of another type) recompile at the next call's first step.
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    assert decoder.generate(PROMPT, NEW).tolist() == generate_reference(model)[0, PROMPT.numel():].tolist()
    int4_with_tied_head(model)
    expected = generate_reference(model)[0, PROMPT.numel():]
    tokens, code = run_and_get_code(decoder.generate, PROMPT, NEW)
    assert tokens.tolist() == expected.tolist()
    # fullgraph=True: one graph; its 15 quantized linears are calls of the int4 op, not dequantize + mm.
    step_code = "\n".join(code)
    assert op_calls(step_code, "linear_int4wo_tiled") >= 15
    assert not any(call in step_code for call in FLOAT_MM_CALLS)
    assert "assert_size_stride(" not in step_code  # STEP_INDUCTOR_DEFAULTS: no per-input / per-op checks
    assert decoder.generate(PROMPT, NEW).tolist() == expected.tolist()   # the recompiled step, replayed
    # inductor's own graph with the int4 weights' inner tensors, not the wrapper that flattens them (Note [Inner replay])
    assert (decoder.replayed_steps, decoder.replay_calls) == (NEW - 2, "inductor")


def test_compiled_lean_decode_with_guards_goes_through_dynamo_every_step():
    model = int4_with_tied_head(tiny_llama(96))
    decoder = LeanDecoder(model, max_length=PROMPT.numel() + NEW, compile=True, skip_guards=False)
    assert decoder.generate(PROMPT, NEW).tolist() == generate_reference(model)[0, PROMPT.numel():].tolist()
    assert (decoder.replayed_steps, decoder.replay_off) == (0, None)


def test_replay_binds_only_a_graph_call_that_took_the_token_and_position():
    backend = ReplayingInductor()
    token, position = torch.tensor([[1]]), torch.tensor([4])
    assert backend.bind(token, position) == (None, "the step did not call an inductor graph")
    step = torch.compile(lambda t, p, w: (w[t[0]] * p).argmax(-1, keepdim=True), fullgraph=True, backend=backend)
    weight = torch.randn(5, 3)
    out = step(token, position, weight)
    replay, why = backend.bind(token, position)
    assert why is None
    assert torch.equal(replay(torch.tensor([[3]]), torch.tensor([2])), step(torch.tensor([[3]]), torch.tensor([2]),
                                                                          weight))
    assert torch.equal(replay(token, position), out)
    assert backend.replay_calls == "inductor"
    # Without a recorded inner call (a graph that is not inductor's CompiledFxGraph) replay calls the outer graph.
    assert torch.equal(step(token, position, weight), out)
    backend._inner = None
    replay, why = backend.bind(token, position)
    assert why is None and backend.replay_calls == "aot_autograd"
    assert torch.equal(replay(torch.tensor([[3]]), torch.tensor([2])), step(torch.tensor([[3]]), torch.tensor([2]),
                                                                          weight))
    assert backend.bind(torch.tensor([[1]]), position)[1] == "the graph does not take the token and the position as inputs"
    backend.forget()
    assert backend.bind(token, position)[0] is None
    assert ReplayingInductor({"size_asserts": True, "freezing": True}).options == {
        "size_asserts": True, "alignment_asserts": False, "scalar_asserts": False, "freezing": True}


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


def test_filled_cache_attention_equals_sdpa_over_the_whole_cache():
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    prefix = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    prefix[..., :13] = True
    holes = prefix.clone()
    holes[..., 4] = False                                              # a mask that is not a prefix is kept
    additive = torch.zeros(1, 1, 1, 40).masked_fill(~holes, torch.finfo(torch.float32).min)
    prefill = torch.ones(5, 40, dtype=torch.bool).tril(diagonal=30).expand(1, 1, 5, 40)  # 5 queries at 26..30
    for mask, queries in ((prefix, q), (holes, q), (additive, q), (prefill, torch.randn(1, 6, 5, 8))):
        want = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        got = torch.ops.torchqkit.sdpa_over_filled_cache(queries, k, v, mask, 0.3, True)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_lean_decode_attends_over_the_filled_cache_and_restores_the_model():
    from torch._inductor.utils import run_and_get_code

    from torchqkit import kernels
    from torchqkit.eval.filled_cache_attention import FILLED_CACHE_SDPA, filled_cache_pays

    model = int4_with_tied_head(tiny_llama(96))
    assert model.config._attn_implementation == "sdpa"
    expected = generate_reference(model)[0, PROMPT.numel():].tolist()
    # The C++ kernel is cheaper than sdpa over any cache; the Python reference only from 256 positions on.
    assert LeanDecoder(model, 16).filled_cache_attention is kernels.CPU_EXTENSION_LOADED
    assert [filled_cache_pays(n, "cuda") for n in (255, 256)] == [False, True]   # the reference serves there
    decoder = LeanDecoder(model, 256, compile=True)
    tokens, code = run_and_get_code(decoder.generate, PROMPT, NEW)
    assert tokens.tolist() == expected and decoder.attention == FILLED_CACHE_SDPA
    assert op_calls("\n".join(code), "sdpa_over_filled_cache") == 2   # 2 layers
    assert model.config._attn_implementation == "sdpa"                    # only while decoding
    with pytest.raises(ValueError, match="new_tokens must be a positive int"):
        decoder.generate(PROMPT, 0)
    assert model.config._attn_implementation == "sdpa"
