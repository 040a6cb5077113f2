"""Tiny seeded transformers Llama models and a byte-level BPE tokenizer, built offline for the eval tests."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: before transformers

SAMPLE_TEXT = (
    "The evening was fine, and the party walked down to the harbour to see the boats come in. "
    "Anne kept a little behind the others, listening to the sea and to the talk of her companions, "
    "and thinking how strange it was that so few years could change so much. "
) * 4


def tiny_llama(vocab_size: int = 96, *, tied: bool = True, bias: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # The default init (std 0.02) gives nearly uniform logits; larger weights make every test sensitive.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
            elif bias:
                param.normal_(0, 0.1)
    return model


def tiny_llama_with_outlier_norms(vocab_size: int = 96):
    """tiny_llama with outlier channels in its norm weights, as real LLMs have: where AWQ, SmoothQuant and GPTQ's
    Hessians matter."""
    model = tiny_llama(vocab_size=vocab_size)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] = 12.0
            layer.post_attention_layernorm.weight[5:7] = 8.0
    return model


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on SAMPLE_TEXT, wrapped as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([SAMPLE_TEXT], vocab_size=vocab_size, min_frequency=1, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
