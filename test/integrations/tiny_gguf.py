"""A tiny LLaMA-architecture GGUF written with gguf-py, one block format per Linear, for from_gguf's tests."""
from __future__ import annotations

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 256, 2, 4, 2, 96
# Each layer's Linears cycle through formats; ffn_down (K = 256) takes the 256-weight K-quants.
LAYER_FORMATS = [
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
     "ffn_up": "Q4_1", "ffn_down": "Q4_K"},
    {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q5_1", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
     "ffn_up": "F16", "ffn_down": "Q6_K"},
]
# Byte offsets of the fp16 scales of block types written as random bytes (the rest of a block may be any bytes).
RAW_BLOCK_F16 = {"Q4_K": [0, 2], "Q6_K": [208], "Q5_K": [0, 2], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0]}


def _random_block_bytes(rng, rows, k, name):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, block_bytes = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, name)]
    raw = rng.integers(0, 256, size=(rows, k // block, block_bytes), dtype=np.uint8)
    for at in RAW_BLOCK_F16[name]:
        scale = (np.abs(rng.standard_normal((rows, k // block))) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


def add_tiny_tokenizer(writer, vocab=VOCAB):
    """A BPE vocabulary of ``vocab`` placeholder tokens and one merge: enough for llama.cpp's loader and save_gguf's
    tokenizer copy."""
    tokens = ["a", "b", "ab"] + [f"<t{i}>" for i in range(3, vocab)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["a b"])  # llama.cpp refuses a BPE vocabulary without merges
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_tokenizer_gguf(path):
    """A GGUF holding only the tiny tokenizer, to copy into exports of models that don't come from a GGUF."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    add_tiny_tokenizer(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama(path, *, seed=0, down_format_override=None, architecture="llama", tied=True, tokenizer=False,
                     layer_formats=None):
    import gguf
    from gguf import GGMLQuantizationType as T
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    if tokenizer:
        add_tiny_tokenizer(w)

    def linear(name, rows, k, fmt):
        if fmt == "F16":
            w.add_tensor(name, (rng.standard_normal((rows, k)) * 0.05).astype(np.float16))
        elif fmt in RAW_BLOCK_F16:
            w.add_tensor(name, _random_block_bytes(rng, rows, k, fmt), raw_dtype=getattr(T, fmt))
        else:
            values = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(values, getattr(T, fmt)), raw_dtype=getattr(T, fmt))

    emb = (rng.standard_normal((VOCAB, HIDDEN)) * 0.1).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, T.Q8_0), raw_dtype=T.Q8_0)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for i, formats in enumerate(layer_formats or LAYER_FORMATS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for kind, (rows, k) in shapes.items():
            fmt = down_format_override if (kind == "ffn_down" and down_format_override) else formats[kind]
            linear(f"blk.{i}.{kind}.weight", rows, k, fmt)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        linear("output.weight", VOCAB, HIDDEN, "Q8_0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
