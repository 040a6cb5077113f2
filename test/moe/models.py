"""Tiny random mixture-of-experts models built from transformers' own configs (hidden 64, top-2, 2 layers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import torchqkit as qk  # noqa: E402

_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=2)
MODELS = ("qwen3_moe", "mixtral", "olmoe")
# What transformers 5.x offers on CPU ("deepgemm" and "sonicmoe" are CUDA-only kernels).
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def tiny_moe(name: str, seed: int = 0, num_experts: int | None = None, **overrides) -> nn.Module:
    """A float32 model with random weights: 8 experts (Mixtral: 4) unless ``num_experts`` says otherwise, 2 of them
    per token. ``overrides``: config values to change (``vocab_size=96`` to match a tokenizer,
    ``norm_topk_prob=True``)."""
    torch.manual_seed(seed)
    common = {**_COMMON, **overrides}
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                             num_experts=num_experts or 8, decoder_sparse_step=1, mlp_only_layers=[])
        return transformers.Qwen3MoeForCausalLM(config).eval()
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, intermediate_size=32,
                                                                          num_local_experts=num_experts or 4)).eval()
    if name == "gpt_oss":  # experts stored transposed, (E, K, N), with biases; an nn.Module "router"
        config = transformers.GptOssConfig(**common, intermediate_size=32, head_dim=16,
                                           num_local_experts=num_experts or 4,
                                           layer_types=["full_attention", "full_attention"])
        model = transformers.GptOssForCausalLM(config).eval()
        with torch.no_grad():  # its experts and biases start at zero (empty / zeros): give them values
            for p in model.parameters():
                p.normal_(0, 0.05)
        return model
    config = transformers.OlmoeConfig(**common, intermediate_size=32, num_experts=num_experts or 8)
    return transformers.OlmoeForCausalLM(config).eval()



def expert_stacks(model: nn.Module) -> dict[str, qk.AffineQuantizedTensor]:
    return {name: p for name, p in model.named_parameters() if isinstance(p, qk.AffineQuantizedTensor) and p.dim() == 3}
