"""Evaluate causal language models: perplexity, decode speed, and loading models and text offline.

    from torchqkit.eval import perplexity, decode_tokens_per_second
    ppl = perplexity(model, tokenizer(text, return_tensors="pt").input_ids, window=512)

`python -m torchqkit eval` compares a model before and after quantization (torchqkit/eval/cli.py).
"""
from .models import EVAL_TEXT_SOURCE, ModelLoadError, eval_text, load_gguf, load_hf, smollm2_gguf_path
from .permute import permute_llama_channels_
from .perplexity import perplexity
from .progress import ProgressLine
from .speed import decode_tokens_per_second

__all__ = ["perplexity", "decode_tokens_per_second", "permute_llama_channels_", "ProgressLine", "ModelLoadError",
           "load_gguf", "load_hf", "smollm2_gguf_path", "eval_text", "EVAL_TEXT_SOURCE"]
