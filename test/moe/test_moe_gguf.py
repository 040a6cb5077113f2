"""save_gguf / from_gguf on tiny Qwen3-MoE and Mixtral models: expert stacks as llama.cpp's ffn_*_exps tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ..integrations.tiny_gguf import VOCAB, write_tokenizer_gguf
from .models import expert_stacks, tiny_moe

gguf = pytest.importorskip("gguf")

import torchqkit as qk  # noqa: E402
from torchqkit.tensor.experts import expert_view  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 40, 95]])
# llama.cpp renormalizes the top-k routing weights of qwen3moe (save_gguf refuses a config that doesn't).
OVERRIDES = {"qwen3_moe": {"norm_topk_prob": True}, "mixtral": {}}


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tokenizer.gguf")


def _model(name, config=None):
    model = tiny_moe(name, vocab_size=VOCAB, **OVERRIDES[name])
    if config is not None:
        qk.quantize_(model, config)
    return model


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


# (config, GGUF type of the expert tensors)
CASES = [(qk.Int4WeightOnlyConfig(group_size=32), "Q4_1"), (qk.Int8WeightOnlyConfig(), "Q8_0"),
         (qk.IntxWeightOnlyConfig(bits=4), "Q4_0")]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("config, gguf_type", CASES, ids=[t for _, t in CASES])
def test_round_trip_keeps_expert_codes_and_logits(name, config, gguf_type, tmp_path, tokenizer_gguf):
    model = _model(name, config)
    report = qk.save_gguf(model, tmp_path / "m.gguf", tokenizer_gguf)
    assert report.architecture == ("qwen3moe" if name == "qwen3_moe" else "llama")
    experts = model.config.num_experts if name == "qwen3_moe" else model.config.num_local_experts
    for layer in range(2):
        for kind in ("gate", "up", "down"):
            entry = report[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert (entry.gguf_type, entry.status) == (gguf_type, "exact"), entry
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    shapes = {t.name: [int(s) for s in t.shape] for t in reader.tensors}
    # ggml dims (K, N, E): gate / up (H, I, E), down (I, H, E); the router (H, E) float.
    inter = model.config.moe_intermediate_size if name == "qwen3_moe" else model.config.intermediate_size
    assert shapes["blk.0.ffn_gate_exps.weight"] == [64, inter, experts] == shapes["blk.0.ffn_up_exps.weight"]
    assert shapes["blk.0.ffn_down_exps.weight"] == [inter, 64, experts]
    assert report["blk.0.ffn_gate_inp.weight"].status == "float"

    again = qk.from_gguf(tmp_path / "m.gguf")
    assert type(again).__name__ == type(model).__name__
    src, back = expert_stacks(model), expert_stacks(again)
    assert sorted(src) == sorted(back)
    for pname, w in src.items():
        b = back[pname]
        assert b.logical_shape == w.logical_shape
        for e in range(w.logical_shape[0]):
            s_codes = w.qlayout.unpack(expert_view(w, e)).qdata.long()
            b_codes = b.qlayout.unpack(expert_view(b, e)).qdata.long()
            shift = (b_codes - s_codes).unique()  # the source's codes shifted by one integer (Q4_0 stores q + 8)
            assert shift.numel() == 1, (pname, e)
        # Only the scales' (and mins') float16 rounding moves a weight: far below one code step (max|w| / 8).
        assert float((b.dequantize() - w.dequantize()).abs().max()) < 2e-3 * float(w.dequantize().abs().max())
    ref = _logits(model)
    torch.testing.assert_close(_logits(again), ref, rtol=0, atol=1e-2 * float(ref.abs().max()))
    # Written back, the expert tensors are the same bytes.
    qk.save_gguf(again, tmp_path / "again.gguf")
    first = {t.name: np.asarray(t.data).tobytes() for t in reader.tensors if "_exps" in t.name}
    second = {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors
              if "_exps" in t.name}
    assert first == second and len(first) == 6


def test_float_experts_round_trip_exactly(tmp_path, tokenizer_gguf):
    model = _model("mixtral")
    report = qk.save_gguf(model, tmp_path / "f.gguf", tokenizer_gguf)
    assert report["blk.1.ffn_up_exps.weight"].gguf_type == "F32"
    again = qk.from_gguf(tmp_path / "f.gguf")
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(again.model.layers[1].mlp.experts.gate_up_proj, gate_up)
    torch.testing.assert_close(_logits(again), _logits(model), rtol=0, atol=1e-5)


def test_experts_without_an_exact_type_name_the_tensor_and_write_nothing(tmp_path, tokenizer_gguf):
    model = _model("qwen3_moe", qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(16)))
    out = tmp_path / "m.gguf"
    with pytest.raises(qk.GGUFError, match=r"blk\.0\.ffn_gate_exps\.weight \(model\.layers\.0\.mlp\.experts\."
                                           r"gate_up_proj.*expert 0: its groups of 16"):
        qk.save_gguf(model, out, tokenizer_gguf)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    report = qk.save_gguf(model, out, tokenizer_gguf, requantize=True)
    assert report["blk.0.ffn_up_exps.weight"].status == "requantized"
    assert report["blk.0.ffn_up_exps.weight"].gguf_type == "Q4_0"
    assert qk.from_gguf(out).model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)


def test_configs_llama_cpp_computes_differently_are_refused(tmp_path, tokenizer_gguf):
    out = tmp_path / "m.gguf"
    with pytest.raises(qk.GGUFError, match="norm_topk_prob=False"):
        qk.save_gguf(tiny_moe("qwen3_moe", vocab_size=VOCAB), out, tokenizer_gguf)
    with pytest.raises(qk.GGUFError, match="model_type 'olmoe' has no GGUF export"):
        qk.save_gguf(tiny_moe("olmoe", vocab_size=VOCAB), out, tokenizer_gguf)
    assert list(tmp_path.iterdir()) == []


def test_llama_cpp_computes_the_same_logits(tmp_path, tokenizer_gguf):
    """llama.cpp loads the exported files; its logits match torchqkit's on the read-back model. llama.cpp
    quantizes activations to 8 bits for its Q4_1 matmuls, so the tolerance is 2% of the largest logit
    (measured: 1.0% Qwen3-MoE, 0.9% Mixtral)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    for name in ("qwen3_moe", "mixtral"):
        model = _model(name, qk.Int4WeightOnlyConfig(group_size=32))
        path = tmp_path / f"{name}.gguf"
        qk.save_gguf(model, path, tokenizer_gguf)
        ref = _logits(qk.from_gguf(path))[0].numpy()
        llm = llama_cpp.Llama(str(path), n_ctx=16, logits_all=True, verbose=False, n_threads=1)
        llm.eval(IDS[0].tolist())
        got = np.asarray(llm.scores[:IDS.shape[1]])
        assert got.shape == ref.shape
        assert float(np.abs(got - ref).max()) <= 2e-2 * float(np.abs(ref).max()), name


def _int8_expert(codes, scale):
    """A 2-d int8 g32 symmetric weight (PlainLayout) with the given codes (N, K) and scales (N, K / 32)."""
    from torchqkit.core.primitives import ZeroPointDomain
    from torchqkit.core.qdtype import int8
    from torchqkit.layouts.base import PlainParts, WeightFormat
    wfmt = WeightFormat.of(int8, (1, 32), codes.shape, ZeroPointDomain.NONE)
    layout = qk.PlainLayout().for_weight(wfmt)
    tensors = layout.pack(PlainParts(codes.to(torch.int8), scale, None), wfmt)
    return qk.AffineQuantizedTensor(tensors, int8, (1, 32), tuple(codes.shape), torch.float32, layout,
                                    ZeroPointDomain.NONE)


def test_experts_that_would_pick_different_types_share_the_widest():
    """Expert 0's codes fit Q4_0 (-8..7), expert 1's only Q8_0: a GGUF tensor has one type, so both are Q8_0 with
    their own codes."""
    from torchqkit.integrations.gguf_encode import encode_exact
    from torchqkit.tensor.experts import stack_experts
    g = torch.Generator().manual_seed(0)
    small = torch.randint(-8, 8, (4, 64), generator=g)
    wide = torch.randint(-100, 101, (4, 64), generator=g)
    scale = torch.full((4, 2), 0.5, dtype=torch.float32)  # a float16 value: nothing rounded
    alone, _ = encode_exact(_int8_expert(small, scale), "e0")
    assert alone.type_name == "Q4_0"
    stack = stack_experts([_int8_expert(small, scale), _int8_expert(wide, scale)], "experts.down_proj")
    enc, why = encode_exact(stack, "blk.0.ffn_down_exps.weight")
    assert why == "" and enc.type_name == "Q8_0" and enc.data.shape == (2, 4, 2 * 34) and enc.rounded == 0
    from gguf.quants import dequantize
    got = dequantize(enc.data.reshape(8, -1), gguf.GGMLQuantizationType.Q8_0).reshape(2, 4, 64)
    assert np.array_equal(got, (torch.stack([small, wide]).float() * 0.5).numpy())


def test_expert_metadata_that_disagrees_with_the_tensors_is_refused(tmp_path, tokenizer_gguf):
    from torchqkit.integrations.gguf_checks import check_hyperparameters
    qk.save_gguf(_model("qwen3_moe"), tmp_path / "m.gguf", tokenizer_gguf)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in reader.tensors}

    def field(overrides):
        def get(key):
            if key in overrides:
                return overrides[key]
            f = reader.get_field(key)
            return None if f is None else f.contents()
        return get

    check_hyperparameters(field({}), tensors, "qwen3moe", "m.gguf", qk.GGUFError)  # the file as written is fine
    for key, value, match in (("qwen3moe.expert_count", 6, r"expert_count = 6 .* blk\.0\.ffn_up_exps\.weight is "
                                                          r"\[8, 32, 64\]"),
                              ("qwen3moe.expert_feed_forward_length", 64, "expert_feed_forward_length = 64"),
                              ("qwen3moe.expert_used_count", 9, r"expert_used_count = 9: must be in \[1, 8\]"),
                              ("qwen3moe.expert_count", None, "expert_count is missing")):
        with pytest.raises(qk.GGUFError, match=match):
            check_hyperparameters(field({key: value}), tensors, "qwen3moe", "m.gguf", qk.GGUFError)


def _rewrite(src, dst, replace, drop=()):
    """``src`` copied to ``dst`` with the tensors named in ``replace`` (name -> (raw bytes, GGML type name)) and
    without the metadata keys in ``drop``."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), reader.get_field("general.architecture").contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, f.contents())
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    for t in reader.tensors:
        data, type_name = replace.get(t.name, (np.asarray(t.data), t.tensor_type.name))
        w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_k_quant_experts_as_llama_cpp_writes_them(tmp_path, tokenizer_gguf):
    """A Q4_K_M-like file: gate / up Q4_K stacks (K = hidden 256) become uint4 g32 expert stacks equal to gguf-py's
    dequantization; a layer whose gate and up decode to different formats is read as float32, with the warning."""
    from ..integrations.tiny_gguf import _random_block_bytes
    model = tiny_moe("qwen3_moe", vocab_size=VOCAB, hidden_size=256, norm_topk_prob=True)
    qk.save_gguf(model, tmp_path / "f.gguf", tokenizer_gguf)
    rng = np.random.default_rng(0)
    formats = {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.0.ffn_up_exps.weight": "Q4_K",
               "blk.1.ffn_gate_exps.weight": "Q4_K", "blk.1.ffn_up_exps.weight": "Q5_K"}
    replace = {}
    for name, fmt in formats.items():
        raw = _random_block_bytes(rng, 8 * 32, 256, fmt)                      # 8 experts x 32 rows, K = 256
        replace[name] = (raw.reshape(8, 32, -1), fmt)
    # llama.cpp's converter gives Qwen3's head size (16 here, not 256 / 4) as key_length, no rope.dimension_count.
    assert gguf.GGUFReader(tmp_path / "f.gguf").get_field("qwen3moe.attention.key_length").contents() == 16
    _rewrite(tmp_path / "f.gguf", tmp_path / "k.gguf", replace, drop=("qwen3moe.rope.dimension_count",))
    with pytest.warns(UserWarning, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj .*decode to different "
                                         r"formats \(Q4_K, Q5_K\)"):
        again = qk.from_gguf(tmp_path / "k.gguf")
    from gguf.quants import dequantize
    want = [torch.from_numpy(dequantize(replace[n][0].reshape(256, -1), gguf.GGMLQuantizationType[f]))
            for n, f in formats.items()]
    assert again.config.head_dim == 16
    stack = again.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(stack, qk.AffineQuantizedTensor) and stack.logical_shape == (8, 64, 256)
    expected0 = torch.cat([want[0].reshape(8, 32, 256), want[1].reshape(8, 32, 256)], dim=1)
    torch.testing.assert_close(stack.dequantize(), expected0, rtol=1e-6, atol=1e-6)
    float1 = again.model.layers[1].mlp.experts.gate_up_proj
    assert not isinstance(float1, qk.AffineQuantizedTensor)
    torch.testing.assert_close(float1, torch.cat([want[2].reshape(8, 32, 256), want[3].reshape(8, 32, 256)], dim=1),
                               rtol=0, atol=0)


def test_llama_cpp_quantized_moe_file_reads_back(tmp_path, tokenizer_gguf):
    """llama.cpp's own quantizer (Q4_0 mix) on the exported float Mixtral / Qwen3-MoE file: from_gguf reads its expert
    tensors into quantized stacks, and its logits match llama.cpp's on that file within 2 % of the largest
    (measured: 0.9 % Qwen3-MoE, 0.8 % Mixtral)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes
    for name in ("qwen3_moe", "mixtral"):
        src, out = tmp_path / f"{name}-f32.gguf", tmp_path / f"{name}-q4_0.gguf"
        qk.save_gguf(_model(name), src, tokenizer_gguf)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.nthread = 1
        assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
        assert types["blk.0.ffn_gate_exps.weight"] == "Q4_0" and types["blk.1.ffn_down_exps.weight"] == "Q4_0"
        model = qk.from_gguf(out)
        stacks = expert_stacks(model)
        assert len(stacks) == 4 and all(s.qdtype.name == "uint4" for s in stacks.values())
        ref = _logits(model)[0].numpy()
        llm = llama_cpp.Llama(str(out), n_ctx=16, logits_all=True, verbose=False, n_threads=1)
        llm.eval(IDS[0].tolist())
        got = np.asarray(llm.scores[:IDS.shape[1]])
        assert float(np.abs(got - ref).max()) <= 2e-2 * float(np.abs(ref).max()), name


def test_moe_architecture_without_an_import_is_named(tmp_path):
    path = tmp_path / "olmoe.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_expert_count(8)
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((8, 32, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(qk.GGUFError, match=r"architecture 'olmoe' is not supported .*qwen3moe"):
        qk.from_gguf(path)
