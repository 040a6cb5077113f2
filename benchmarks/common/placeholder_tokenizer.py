"""A GGUF holding only a placeholder tokenizer, for save_gguf exports of models that have none (random-weight
models read any ids): ``vocab`` BPE tokens ("a", "b", "ab", " ", then "<tN>") and one merge."""
from __future__ import annotations

from pathlib import Path


def placeholder_tokenizer(path: Path, vocab: int, architecture: str = "llama") -> Path:
    """Write the placeholder tokenizer GGUF to ``path`` and return it."""
    import gguf
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    # " " lets llama.cpp tokenize a prompt of several words (benchmarks/moe_decode.py's PEER_PROMPT)
    w.add_token_list(["a", "b", "ab", " "] + [f"<t{i}>" for i in range(4, vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a b"])  # llama.cpp refuses a BPE vocabulary without merges
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
