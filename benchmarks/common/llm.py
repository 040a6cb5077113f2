"""The causal LM the model-level groups measure: SmolLM2-135M (its packaged GGUF, dequantized to float32 by
transformers), or with --quick a tiny random LLaMA of the same architecture (seconds to build; its figures check the
code, they mean nothing), and the quantized copies the groups compare."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

import torchqkit as qk
from torchqkit.api.fuse import FusedLinearMember

from .configs import build

TINY_VOCAB = 512


@dataclass
class LLM:
    name: str
    model: torch.nn.Module
    tokenize: Callable[[str], torch.Tensor]  # text -> 1-D token ids
    gguf: object = None                      # the GGUF file's path (None for the tiny model)


def tiny_llama() -> torch.nn.Module:
    """SmolLM2's architecture (GQA, SwiGLU, tied lm_head) at toy size, random weights from seed 0. The MLP width, 256,
    lets 2 ranks shard down_proj's K into tiles of 128 (the distributed group's int4 layout cuts only there)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _byte_ids(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % TINY_VOCAB


def load(quick: bool) -> LLM:
    if quick:
        return LLM("tiny-llama (random, --quick)", tiny_llama(), _byte_ids)
    from torchqkit.eval import load_gguf, smollm2_gguf_path
    path = smollm2_gguf_path()
    model, tokenizer = load_gguf(path)
    return LLM("SmolLM2-135M", model, lambda text: tokenizer(text, return_tensors="pt", verbose=False).input_ids[0],
               path)


def quantized_copy(base: torch.nn.Module, config_name: str, lm_head: bool = True):
    """(a copy of base quantized by the named config, 'quantized/offered' Linears). lm_head=True quantizes the
    lm_head too, once, still tied to the embedding (the embedding gathers rows of the same tensor); False keeps it
    float."""
    model = copy.deepcopy(base)
    config = build(config_name)
    if config is None:
        return model, "-"
    if isinstance(config, qk.ModuleConfigs):  # a body + output preset: it decides the lm_head itself
        configs = qk.ModuleConfigs({**config.configs, **({} if lm_head else {"lm_head": None})})
    else:
        configs = qk.ModuleConfigs({"lm_head": config if lm_head else None, "_default": config})
    report = qk.quantize_(model, configs)
    tied = getattr(base.config, "tie_word_embeddings", False)
    if lm_head and tied and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("the lm_head is no longer tied to the embedding")
    return model, f"{len(report.quantized)}/{len(report)}"


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes; tensor subclasses (torchqkit's, and peers') summed over their __tensor_flatten__ tensors."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def weight_mb_per_token(model) -> float:
    """MB a decode step reads from weights: every Linear's (a tied lm_head once; a fused group's weight once)."""
    seen, total = set(), 0
    for module in model.modules():
        if not isinstance(module, (torch.nn.Linear, FusedLinearMember)):
            continue
        weight = module.group.weight if isinstance(module, FusedLinearMember) else module.weight
        if id(weight) not in seen:
            seen.add(id(weight))
            total += tensor_bytes(weight)
    return total / 1e6
