"""save_gguf: quantized weights written in the GGUF type that holds their codes, read back by from_gguf with the
same codes and float16 scales; files from_gguf read written back byte for byte; refusals before anything is written;
the export command."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torchqkit as qk
from torchqkit.core.primitives import ZeroPointDomain

from .tiny_gguf import FFN, HIDDEN, KV_HEADS, HEADS, VOCAB, write_tiny_llama, write_tokenizer_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

LEGACY = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
          "ffn_up": "F16", "ffn_down": "Q8_0"}


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tokenizer.gguf")


def _tiny_model(seed=0):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def _logits(model, seed=0):
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def _per_block32(t, w):
    """A source qparam (rows / bn, K / bk) expanded to one value per row and 32-block, as from_gguf reads them."""
    n, k = w.logical_shape
    bn, bk = w.block_size
    return t[torch.arange(n) // bn][:, (torch.arange(k // 32) * 32) // bk]


# (config, GGUF type every Linear gets)
CASES = [
    (qk.Int4WeightOnlyConfig(group_size=32), "Q4_1"),
    (qk.Int4WeightOnlyConfig(group_size=128, layout=qk.PlainLayout()), "Q4_1"),
    (qk.IntxWeightOnlyConfig(bits=4), "Q4_0"),
    (qk.Int8WeightOnlyConfig(), "Q8_0"),
    (qk.IntxWeightOnlyConfig(bits=5), "Q5_0"),
    (qk.IntxWeightOnlyConfig(bits=5, granularity=qk.PerGroup(64), algorithm="hqq"), "Q5_1"),
    (qk.IntxWeightOnlyConfig(bits=6, granularity=qk.PerGroup(32)), "Q8_0"),
]


@pytest.mark.parametrize("config, gguf_type", CASES, ids=[c.describe() for c, _ in CASES])
def test_round_trip_keeps_codes_and_float16_scales(config, gguf_type, tmp_path, tokenizer_gguf):
    model = _tiny_model()
    qk.quantize_(model, config)
    report = qk.save_gguf(model, tmp_path / "m.gguf", tokenizer_gguf)
    assert report.types[gguf_type] == 14 and len(report.exact) == 14 and not report.requantized
    assert all(t.scales_rounded > 0 for t in report.exact)  # float32 scales: float16 changes some of each
    assert report["token_embd.weight"].gguf_type == "F32" and "output.weight" not in [t.name for t in report.tensors]
    again = qk.from_gguf(tmp_path / "m.gguf")
    for name, module in _linears(model).items():
        src, back = module.weight, again.get_submodule(name).weight
        s_parts, b_parts = src.qlayout.unpack(src), back.qlayout.unpack(back)
        # The codes are the source's, shifted by one integer per tensor (Q4_0 stores q + 8, Q5_0 int5 as is).
        shift = b_parts.qdata.long() - s_parts.qdata.long()
        assert shift.unique().numel() == 1, name
        # Scales: the source's rounded to float16, one per 32-block.
        assert torch.equal(b_parts.scale, _per_block32(s_parts.scale, src).half().float()), name
        # Dequantized: equal within the float16 rounding of scales and mins (2^-11 of each term, 2^-10 here);
        # one wrong code would move a weight by a whole scale, about max|w| / 8.
        w = src.dequantize()
        bound = 2 ** -10 * (float(w.abs().max()) + _min_bound(s_parts, src))
        assert float((back.dequantize() - w).abs().max()) <= bound, name
    ref = _logits(model)
    torch.testing.assert_close(_logits(again), ref, rtol=0, atol=2e-2 * float(ref.abs().max()))


def _min_bound(parts, w):
    """A bound on |m| = |z - mid s| of the Q4_1 / Q5_1 blocks a float zero point becomes."""
    if ZeroPointDomain(w.zero_point_domain) is not ZeroPointDomain.FLOAT:
        return 0.0
    return float(parts.zero_point.abs().max()) + 32 * float(parts.scale.abs().max())


def test_file_from_gguf_is_written_back_byte_for_byte(tmp_path):
    """Every legacy type, an F16 Linear and the Q8_0 embedding: identical tensor bytes, identical logits."""
    src = write_tiny_llama(tmp_path / "src.gguf", tokenizer=True, layer_formats=[LEGACY, LEGACY], tied=False)
    model = qk.from_gguf(src)
    report = qk.save_gguf(model, tmp_path / "out.gguf")
    assert report.tokenizer == "tokenizer copied from src.gguf"
    assert {t.note for t in report.exact} == {"scales already float16: values identical"}
    assert {t.scales_rounded for t in report.exact} == {0}
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(tmp_path / "out.gguf")
    theirs = {t.name: t for t in b.tensors}
    assert sorted(theirs) == sorted(t.name for t in a.tensors)
    for t in a.tensors:
        u = theirs[t.name]
        assert u.tensor_type == t.tensor_type, t.name
        assert np.array_equal(np.asarray(u.data).view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
    assert b.fields["tokenizer.ggml.tokens"].contents() == a.fields["tokenizer.ggml.tokens"].contents()
    assert torch.equal(_logits(qk.from_gguf(tmp_path / "out.gguf")), _logits(model))


def test_k_quant_with_16_weight_groups_is_refused_and_nothing_is_written(tmp_path):
    # Layer 1's ffn_down is Q6_K: groups of 16 (int8 codes where random sub-scales are negative next to -32)
    src = write_tiny_llama(tmp_path / "k.gguf", tokenizer=True)
    model = qk.from_gguf(src)
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous file")
    with pytest.raises(qk.GGUFError, match=r"blk\.1\.ffn_down\.weight \(model\.layers\.1\.mlp\.down_proj\.weight, "
                                           r"int[68] block \[1, 16\].*groups of 16 .*requantize=True"):
        qk.save_gguf(model, out)
    assert out.read_bytes() == b"previous file"
    assert {p.name for p in tmp_path.iterdir()} == {"k.gguf", "out.gguf"}  # no temporary left behind
    report = qk.save_gguf(model, out, requantize=True)
    entry = report["blk.1.ffn_down.weight"]
    assert (entry.status, entry.gguf_type) == ("requantized", "Q8_0") and "groups of 16" in entry.note
    # Q4_K's sub-block scales d * sc need 17 bits: exact codes in Q4_1, scales rounded to float16 and counted.
    q4k = report["blk.0.ffn_down.weight"]
    assert (q4k.status, q4k.gguf_type) == ("exact", "Q4_1") and "rounded to float16" in q4k.note
    assert qk.from_gguf(out).model.layers[1].mlp.down_proj.weight.shape == (HIDDEN, FFN)


@pytest.mark.parametrize("config, match", [
    (qk.NF4WeightOnlyConfig(), r"nf4 codes are not integers"),
    (qk.IntxWeightOnlyConfig(bits=8, mapping="asymmetric"), r"int8 codes span more than 32 values"),
    (qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(16)), r"groups of 16 along K"),
    (qk.Float8WeightOnlyConfig(weight_dtype="float8_e4m3fnuz"),
     r"float8_e4m3fnuz codes \(AMD's float8\) have no GGUF type .* pass requantize=True .*\(save_quantized"),
])
def test_unmappable_layouts_name_the_tensor_and_write_nothing(config, match, tmp_path, tokenizer_gguf):
    model = _tiny_model()
    qk.quantize_(model, config)
    out = tmp_path / "m.gguf"
    with pytest.raises(qk.GGUFError, match=r"blk\.0\.attn_q\.weight \(model\.layers\.0\.self_attn\.q_proj\.weight, "
                                           r".*" + match):
        qk.save_gguf(model, out, tokenizer_gguf)
    assert list(tmp_path.iterdir()) == []
    report = qk.save_gguf(model, out, tokenizer_gguf, requantize=True)
    assert len(report.requantized) == 14 and not report.exact


def test_llama_q_k_rows_are_written_in_llama_cpp_order(tmp_path, tokenizer_gguf):
    """transformers' float model against transformers' own GGUF loader reading the exported file."""
    model = _tiny_model(seed=3)
    qk.save_gguf(model, tmp_path / "f.gguf", tokenizer_gguf)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="f.gguf", dtype=torch.float32)
    assert torch.equal(_logits(reference.eval()), _logits(model))


def test_bad_input_errors(tmp_path, tokenizer_gguf):
    model = _tiny_model()
    with pytest.raises(qk.GGUFError, match="no tokenizer: pass tokenizer="):
        qk.save_gguf(model, tmp_path / "m.gguf")
    with pytest.raises(qk.GGUFError, match="model_type 'gpt2' has no GGUF export"):
        qk.save_gguf(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)),
                     tmp_path / "m.gguf", tokenizer_gguf)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "m.gguf").write_bytes(b"previous file")
    with pytest.raises(qk.GGUFError, match="missing.gguf"):
        qk.save_gguf(model, tmp_path / "m.gguf", tmp_path / "missing.gguf")
    # A tokenizer without tokens fails while writing: the temporary is removed, the earlier file kept.
    empty = tmp_path / "empty.gguf"
    w = gguf.GGUFWriter(str(empty), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(qk.GGUFError, match="no tokenizer.ggml.tokens"):
        qk.save_gguf(model, tmp_path / "m.gguf", empty)
    assert (tmp_path / "m.gguf").read_bytes() == b"previous file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.gguf", "m.gguf"]


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(Path(qk.__file__).parents[1])}
    return subprocess.run([sys.executable, "-m", "torchqkit", "export", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_export_command(tmp_path, tokenizer_gguf):
    src = write_tiny_llama(tmp_path / "src.gguf", tokenizer=True, layer_formats=[LEGACY, LEGACY])
    done = _cli(src, "--gguf", tmp_path / "out.gguf", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # 12 quantized Linears (2 are F16) and the Q8_0 embedding
    assert "blk.0.attn_q.weight" in done.stdout and "13 exact, 0 requantized" in done.stdout
    model = _tiny_model()
    qk.quantize_(model, qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(16)))
    qk.save_pretrained(model, tmp_path / "ckpt")
    refused = _cli(tmp_path / "ckpt", "--gguf", tmp_path / "c.gguf", "--tokenizer", tokenizer_gguf, cwd=tmp_path)
    assert refused.returncode == 1 and "groups of 16" in refused.stderr and not (tmp_path / "c.gguf").exists()
    done = _cli(tmp_path / "ckpt", "--gguf", tmp_path / "c.gguf", "--tokenizer", tokenizer_gguf, "--requantize",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "14 requantized" in done.stdout and (tmp_path / "c.gguf").is_file()


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_qwen2_and_mistral_read_back_by_transformers(kind, tmp_path, tokenizer_gguf):
    """Qwen2's q / k / v biases and unpermuted rows; Mistral written as llama. transformers' own GGUF loader."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                  tie_word_embeddings=False)
    config = (transformers.Qwen2Config(**common) if kind == "qwen2" else transformers.MistralConfig(**common))
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.bias.normal_()
    report = qk.save_gguf(model, tmp_path / "m.gguf", tokenizer_gguf)
    assert report.architecture == ("qwen2" if kind == "qwen2" else "llama")
    assert report["output.weight"].gguf_type == "F32"  # untied: written
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    torch.testing.assert_close(_logits(reference.eval()), _logits(model), rtol=0, atol=1e-5)


def test_transformers_tokenizer_is_written(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"a": 0, "b": 1, "ab": 2, "<s>": 3, "</s>": 4, **{f"x{i}": i for i in range(5, VOCAB - 10)}}
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("a", "b")]))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)  # byte-level BPE, as GPT-2's
    bpe.decoder = tokenizers.decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    model = _tiny_model()
    report = qk.save_gguf(model, tmp_path / "m.gguf", tok)
    assert report.tokenizer == f"tokenizer from {type(tok).__name__}"
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == VOCAB and tokens[:3] == ["a", "b", "ab"] and tokens[-1] == f"[PAD{VOCAB - 1}]"
    assert fields["tokenizer.ggml.merges"].contents() == ["a b"]
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 4


@pytest.mark.skipif(not os.environ.get("TORCHQKIT_PEER_PYTHON"),
                    reason="needs TORCHQKIT_PEER_PYTHON: a Python with llama-cpp-python")
def test_llama_cpp_reads_the_export_with_torchqkit_perplexity(tmp_path, tokenizer_gguf):
    """llama.cpp's perplexity of an int4 g32 export on the same ids equals torchqkit's within 0.5% (llama.cpp
    quantizes activations to 8 bits inside its Q4_1 dot products; the float32 export agrees within 0.01%)."""
    import json
    model = _tiny_model()
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
    qk.save_gguf(model, tmp_path / "m.gguf", tokenizer_gguf)
    ids = torch.randint(0, VOCAB, (256,), generator=torch.Generator().manual_seed(0))
    (tmp_path / "ids.json").write_text(json.dumps(ids.tolist()))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_llama_cpp_quality.py"
    done = subprocess.run([os.environ["TORCHQKIT_PEER_PYTHON"], str(script), "perplexity", str(tmp_path / "m.gguf"),
                           "--ids", str(tmp_path / "ids.json"), "--window", "64"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)["perplexity"]
    from torchqkit.eval import perplexity
    ours = perplexity(model, ids, 64, progress=False)
    assert abs(theirs - ours) / ours < 5e-3, (theirs, ours)


def test_smollm2_file_is_written_back_byte_for_byte(tmp_path):
    """SmolLM2-135M's packaged GGUF (210 Q4_1 Linears, a Q8_0 embedding, 61 F32 norms): from_gguf, save_gguf, and
    every tensor has the same type and bytes; llama.cpp reads the result (benchmarks/gguf_export.py)."""
    from torchqkit.eval import ModelLoadError, smollm2_gguf_path
    try:
        source = smollm2_gguf_path()
    except ModelLoadError as err:
        pytest.skip(str(err))
    report = qk.save_gguf(qk.from_gguf(source, progress=False), tmp_path / "again.gguf", progress=False)
    assert report.types == {"Q4_1": 210, "Q8_0": 1, "F32": 61} and len(report.exact) == 211
    theirs = {t.name: t for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors}
    for t in gguf.GGUFReader(source).tensors:
        u = theirs.pop(t.name)
        assert u.tensor_type == t.tensor_type, t.name
        assert np.array_equal(np.asarray(u.data).view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
    assert not theirs


def test_gguf_options_are_refused_with_another_target(tmp_path, capsys):
    from torchqkit.cli import main
    assert main(["export", str(tmp_path), "--compressed-tensors", str(tmp_path / "ct"), "--requantize"]) == 2
    assert "--requantize and --tokenizer apply to --gguf only" in capsys.readouterr().err
    assert not (tmp_path / "ct").exists()
