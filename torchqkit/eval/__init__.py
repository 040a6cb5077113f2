"""Evaluate causal language models: perplexity, decode speed, and loading models and text offline.

    from torchqkit.eval import perplexity, decode_tokens_per_second, greedy_decode
    ppl = perplexity(model, tokenizer(text, return_tensors="pt").input_ids, window=512)
    ids = greedy_decode(model, prompt_ids, 32, compile=True)     # static KV cache, compiled one-token step
    tok_s = decode_tokens_per_second(model, prompt_ids, decode="lean", compile=True)

`python -m torchqkit eval` compares a model before and after quantization (torchqkit/eval/cli.py).
"""
from .breakdown import DecodeBreakdown, decode_breakdown
from .cached_perplexity import cached_perplexity
from .decode import LeanDecoder, greedy_decode
from .models import EVAL_TEXT_SOURCE, ModelLoadError, eval_text, load_gguf, load_hf, smollm2_gguf_path
from .permute import permute_llama_channels_
from .perplexity import perplexity
from ..progress import ProgressLine
from .speed import DECODE_LOOPS, DecodeLoop, decode_tokens_per_second

__all__ = ["perplexity", "cached_perplexity", "decode_tokens_per_second", "DecodeLoop", "DECODE_LOOPS", "greedy_decode",
           "LeanDecoder",
           "decode_breakdown", "DecodeBreakdown", "permute_llama_channels_",
           "ProgressLine", "ModelLoadError", "load_gguf", "load_hf", "smollm2_gguf_path", "eval_text",
           "EVAL_TEXT_SOURCE"]
