"""GGUF: import a llama.cpp file with its quantized blocks kept as torchqkit layouts.

Run: python tutorials/07_gguf.py   (CPU; writes a small random-weight GGUF with gguf-py; about 5 s on 2 cores)

qk.from_gguf copies each block's codes bit for bit into a layout (Q4_0 / Q4_1 / Q4_K -> int4 tiled, Q8_0 -> int8,
...), so nothing is re-rounded and no float copy of a weight is made; transformers' own GGUF loader dequantizes
everything to float32. A real file works the same: qk.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf").
"""
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoModelForCausalLM

import torchqkit as qk

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 128, 256, 2, 4, 2, 256


def write_gguf(path: Path) -> None:
    """A LLaMA-architecture GGUF, the Linears in Q4_0 / Q4_1 / Q8_0, as llama.cpp's converter would write it."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, LAYERS), (w.add_context_length, 256), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, VOCAB)]:
        add(value)

    def quantized(name, rows, k, kind):
        values = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    quantized("token_embd.weight", VOCAB, HIDDEN, T.Q8_0)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for kind, rows, k, fmt in [("attn_q", HIDDEN, HIDDEN, T.Q4_0), ("attn_k", KV_HEADS * head_dim, HIDDEN, T.Q4_1),
                                   ("attn_v", KV_HEADS * head_dim, HIDDEN, T.Q8_0), ("attn_output", HIDDEN, HIDDEN, T.Q4_0),
                                   ("ffn_gate", FFN, HIDDEN, T.Q4_1), ("ffn_up", FFN, HIDDEN, T.Q4_1),
                                   ("ffn_down", HIDDEN, FFN, T.Q8_0)]:
            quantized(f"blk.{i}.{kind}.weight", rows, k, fmt)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "tiny.Q4.gguf"
    write_gguf(path)

    # Every file is checked first (tensor byte ranges, hyperparameters against the tensors, finite scales).
    model = qk.from_gguf(path, progress=False)
    print(model.torchqkit_report)  # bytes in the file / here: fp16 scales are kept as float32 (SmolLM2: 98 -> 118 MB)

    # transformers' loader, for comparison: the same function, in float32.
    reference = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    print(f"max |logit difference| to transformers' dequantized model: {diff:.1e}")
    assert diff < 1e-3
    print("q_proj weight:", type(model.model.layers[0].self_attn.q_proj.weight).__name__)
