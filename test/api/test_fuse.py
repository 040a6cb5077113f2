"""fuse_shared_input_linears (Note [Fused projections] in torchqkit/api/fuse.py): one quantized matmul for the q/k/v
and gate/up projections, the same weights and outputs, members kept as views, and every group it can't fuse named
with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.api.fuse import FusedLinearMember
from torchqkit.eval import LeanDecoder

from ..common import op_calls
from ..eval.models import tiny_llama

PROMPT = torch.tensor([[5, 17, 3, 42, 8, 60, 11]])
CONFIGS = {
    "int4 g32": qk.Int4WeightOnlyConfig(group_size=32),
    "int4 g32 bf16 scales, plain": qk.Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.bfloat16,
                                                           layout=qk.PlainLayout()),
    "int8": qk.Int8WeightOnlyConfig(),
    "int8 dynamic": qk.Int8DynamicActivationInt8WeightConfig(),
    "nf4": qk.NF4WeightOnlyConfig(block_size=32),
}
GROUPS = ["model.layers.0.self_attn.q_proj+k_proj+v_proj", "model.layers.0.mlp.gate_proj+up_proj",
          "model.layers.1.self_attn.q_proj+k_proj+v_proj", "model.layers.1.mlp.gate_proj+up_proj"]


def _quantized(config, bias=False):
    model = tiny_llama(96, bias=bias)
    qk.quantize_(model, config)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_model_has_the_same_weights_and_logits(name):
    model = _quantized(CONFIGS[name], bias=name == "int8")
    fused = copy.deepcopy(model)
    assert qk.fuse_shared_input_linears(fused) == dict.fromkeys(GROUPS, "fused")
    attn, ref_attn = fused.model.layers[1].self_attn, model.model.layers[1].self_attn
    for proj in ("q_proj", "k_proj", "v_proj"):
        member, original = getattr(attn, proj), getattr(ref_attn, proj)
        assert isinstance(member, FusedLinearMember) and member.weight.shape == original.weight.shape
        assert torch.equal(member.weight.dequantize(), original.weight.dequantize())  # the same weights, bit for bit
        if name == "int8":
            assert torch.equal(member.bias, original.bias)
    # the members' weights are views of the one fused tensor (its storage, not copies)
    storage = attn.q_proj.group.weight.qdata.untyped_storage().data_ptr()
    assert all(getattr(attn, p).weight.qdata.untyped_storage().data_ptr() == storage for p in ("k_proj", "v_proj"))
    with torch.inference_mode():
        ref, out = model(PROMPT).logits, fused(PROMPT).logits
    # Each output row is the same kernel's dot product over the same k: only the blocking of rows may differ.
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert attn.q_proj.group._x is None  # no activation held once every member took its part


def test_a_member_called_alone_or_on_another_input_is_still_right():
    model = _quantized(CONFIGS["int4 g32"])
    fused = copy.deepcopy(model)
    qk.fuse_shared_input_linears(fused)
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    attn, ref = fused.model.layers[0].self_attn, model.model.layers[0].self_attn
    with torch.inference_mode():
        torch.testing.assert_close(attn.v_proj(x), ref.v_proj(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(attn.q_proj(x), ref.q_proj(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(attn.k_proj(y), ref.k_proj(y), rtol=0, atol=1e-5)  # not the held x: computed
        torch.testing.assert_close(attn.k_proj(x), F.linear(x, ref.k_proj.weight), rtol=0, atol=1e-5)


def test_a_fused_model_moved_after_fusing_says_so():
    fused = _quantized(CONFIGS["int8"])
    qk.fuse_shared_input_linears(fused)
    with pytest.raises(RuntimeError, match=r"fused projection's weight is on cpu, its input on meta: model.to\(\) "
                                           r"moves the members' views, not the fused weight; fuse after moving"):
        fused.model.layers[0].mlp.gate_proj(torch.empty(2, 32, device="meta"))


def test_input_scales_are_carried_when_equal_and_refused_when_not():
    # Note [Input scale]: a per-input-channel scale kept on the weight (AWQ / SmoothQuant where it can't be folded)
    model = _quantized(CONFIGS["int4 g32"])
    scale = torch.rand(32, generator=torch.Generator().manual_seed(3)) + 0.5
    for layer in model.model.layers:
        for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            module = getattr(layer.self_attn if proj[0] in "qkv" else layer.mlp, proj)
            s = scale * 2 if (proj == "up_proj" and layer is model.model.layers[1]) else scale
            module.weight = torch.nn.Parameter(module.weight.with_changes(tensors={"input_scale": s}), requires_grad=False)
    fused = copy.deepcopy(model)
    report = qk.fuse_shared_input_linears(fused)
    assert report["model.layers.1.mlp.gate_proj+up_proj"] == "left as it was: their input scales (Note [Input scale]) differ"
    assert [k for k, v in report.items() if v == "fused"] == GROUPS[:3]
    assert torch.equal(fused.model.layers[0].self_attn.q_proj.group.weight.input_scale, scale)
    with torch.inference_mode():
        ref, out = model(PROMPT).logits, fused(PROMPT).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_groups_it_cannot_fuse_are_left_as_they_were_and_named():
    plain = tiny_llama(96)
    assert set(qk.fuse_shared_input_linears(plain).values()) == {"left as it was: not all quantized (quantize_ first)"}
    mixed = tiny_llama(96)
    qk.quantize_(mixed, qk.ModuleConfigs({"_default": qk.Int4WeightOnlyConfig(group_size=32),
                                          r"re:.*\.k_proj": qk.Int8WeightOnlyConfig()}))
    before = {n: m for n, m in mixed.named_modules()}
    report = qk.fuse_shared_input_linears(mixed)
    assert report["model.layers.0.self_attn.q_proj+k_proj+v_proj"] == "left as it was: their qdtype differ"
    assert report["model.layers.0.mlp.gate_proj+up_proj"] == "fused"
    attn = mixed.model.layers[0].self_attn
    assert attn.q_proj is before["model.layers.0.self_attn.q_proj"] and type(attn.k_proj) is torch.nn.Linear
    # NF4 double quantization packs its scales lossily per 256: fusing would change the weights, so it refuses
    dq = _quantized(qk.NF4WeightOnlyConfig(block_size=32, double_quant=True))
    report = qk.fuse_shared_input_linears(dq)
    assert report["model.layers.0.mlp.gate_proj+up_proj"] == (
        "left as it was: packing their concatenated codes changes the weights (NF4Layout re-quantizes its scales "
        "when it packs)")
    assert type(dq.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_compiled_lean_decode_of_a_fused_model_takes_one_call_per_group():
    from torch._inductor.utils import run_and_get_code

    model = _quantized(CONFIGS["int4 g32"])
    fused = copy.deepcopy(model)
    qk.fuse_shared_input_linears(fused)
    new = 6
    expected = LeanDecoder(model, max_length=PROMPT.numel() + new).generate(PROMPT[0], new)
    decoder = LeanDecoder(fused, max_length=PROMPT.numel() + new, compile=True)
    tokens, code = run_and_get_code(decoder.generate, PROMPT[0], new)
    assert tokens.tolist() == expected.tolist()
    # 2 layers x (q/k/v, o, gate/up, down): 8 calls, where the unfused step makes 14 (the tied lm_head stays float)
    assert op_calls("\n".join(code), "linear_int4wo_tiled") == 8
    assert decoder.replay_off is None and decoder.replayed_steps == new - 2


# Real models: SmolLM2-135M (the packaged Q4_1 GGUF, int4 g32 with bf16 scales, as `python -m benchmarks decode`
# decodes it) and all-MiniLM-L6-v2 (int8, BERT's query / key / value).
def test_smollm2_fused_decodes_the_same_logits():
    from torchqkit.eval import load_gguf, smollm2_gguf_path

    model, tokenizer = load_gguf(smollm2_gguf_path())
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.bfloat16))
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = model(ids).logits
        report = qk.fuse_shared_input_linears(model)
        out = model(ids).logits
    assert len(report) == 60 and set(report.values()) == {"fused"}  # 30 layers x (q/k/v, gate/up)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (192, 576)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(out[0].argmax(-1), ref[0].argmax(-1))


def test_minilm_fused_encodes_the_same_embeddings():
    from torchqkit.demo import load_model

    model = load_model()
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    sentences = ["A man is eating food.", "The new movie is awesome.", "A cheetah runs behind its prey."]
    ref = model.encode(sentences, convert_to_tensor=True)
    report = qk.fuse_shared_input_linears(model)
    assert len(report) == 6 and set(report.values()) == {"fused"}  # 6 layers' query / key / value
    out = model.encode(sentences, convert_to_tensor=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
