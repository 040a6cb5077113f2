"""Reorder a Llama-style decoder's hidden, MLP-intermediate and value-head channels without changing what
it computes (see Note [Function-preserving permutation])."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["permute_llama_channels_"]

# Note [Function-preserving permutation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Why: a model that was dequantized from a group-wise format (a GGUF Q4_1 file: groups of 32 along K)
# has Linear weights that sit exactly on that format's grid, so the same format applied again is lossless
# and says nothing about a quantizer. Reordering input channels moves values of different original groups
# into one group, and the model computes the same function. Shapes: W is (N, K) = (out, in).
#   hidden P (residual stream, size H): every tensor indexed by the hidden dim is reordered the same way:
#     embedding columns, RMSNorm weights (a norm over the whole vector doesn't care about order),
#     K of q/k/v/gate/up, N of o/down (and their biases), K of lm_head (tied or not).
#   intermediate Q_l (size I, per layer): N of gate/up, K of down. SiLU(gate) * up is elementwise.
#   value head dims R_{l,h} (size head_dim, per layer and KV head): N of v's rows of head h, K of o's
#     columns for every query head that reads KV head h (query head q reads KV head q // (heads / kv_heads)).
#     Attention weights don't depend on v, and each output channel of a head is a weighted sum of the same
#     channel of v, so reordering v's channels reorders the head's output channels.
# Not permuted: q/k head dims. RoPE rotates fixed channel pairs (i, i + head_dim / 2) and q.k sums over
# them, so reordering inside a q/k head would change the result. o's K groups therefore only mix channels
# of one value head (two Q4_1 groups at head_dim 64); every other Linear's K groups mix channels from
# across the whole hidden or intermediate dimension.


def permute_llama_channels_(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Permute `model`'s hidden, intermediate and value-head channels in place; the logits don't change
    beyond float rounding (sums are added in another order). Returns the hidden permutation under "hidden"
    and each layer's intermediate / value ones under "layers.<i>.mlp" / "layers.<i>.v".

    model: a transformers Llama-style causal LM (LlamaForCausalLM and relatives with the same module
    names: model.embed_tokens, model.layers[i].self_attn.{q,k,v,o}_proj, .mlp.{gate,up,down}_proj,
    .input_layernorm, .post_attention_layernorm, model.norm, lm_head). See Note [Function-preserving
    permutation]; a tied lm_head stays tied.
    """
    decoder, config = _llama_parts(model)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randperm(config.hidden_size, generator=gen)
    perms = {"hidden": hidden}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    with torch.no_grad():
        _reorder(decoder.embed_tokens.weight, hidden, dim=1)
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None and lm_head.weight is not decoder.embed_tokens.weight:
            _reorder(lm_head.weight, hidden, dim=1)
        _reorder(decoder.norm.weight, hidden, dim=0)
        for i, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                _reorder(norm.weight, hidden, dim=0)
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _reorder(linear.weight, hidden, dim=1)
            for linear in (attn.o_proj, mlp.down_proj):
                _reorder(linear.weight, hidden, dim=0)
                _reorder(linear.bias, hidden, dim=0)
            inner = torch.randperm(mlp.gate_proj.out_features, generator=gen)
            for linear in (mlp.gate_proj, mlp.up_proj):
                _reorder(linear.weight, inner, dim=0)
                _reorder(linear.bias, inner, dim=0)
            _reorder(mlp.down_proj.weight, inner, dim=1)
            value = torch.stack([torch.randperm(head_dim, generator=gen) for _ in range(kv_heads)])
            v_rows = (value + head_dim * torch.arange(kv_heads)[:, None]).reshape(-1)
            _reorder(attn.v_proj.weight, v_rows, dim=0)
            _reorder(attn.v_proj.bias, v_rows, dim=0)
            per_query = value.repeat_interleave(heads // kv_heads, dim=0)
            o_cols = (per_query + head_dim * torch.arange(heads)[:, None]).reshape(-1)
            _reorder(attn.o_proj.weight, o_cols, dim=1)
            perms[f"layers.{i}.mlp"], perms[f"layers.{i}.v"] = inner, value
    return perms


def _reorder(tensor: torch.Tensor | None, order: torch.Tensor, dim: int) -> None:
    if tensor is not None:
        tensor.copy_(tensor.index_select(dim, order.to(tensor.device)))


def _llama_parts(model: nn.Module):
    decoder = getattr(model, "model", None)
    config = getattr(model, "config", None)
    needed = ("hidden_size", "num_attention_heads", "num_key_value_heads")
    if decoder is None or config is None or not all(hasattr(config, name) for name in needed):
        raise ValueError(f"permute_llama_channels_ needs a transformers Llama-style causal LM (.model, .config "
                         f"with {', '.join(needed)}), got {type(model).__name__}")
    for name in ("embed_tokens", "layers", "norm"):
        if not hasattr(decoder, name):
            raise ValueError(f"permute_llama_channels_: {type(model).__name__}.model has no {name!r}; only "
                             f"Llama-style module names are supported")
    layer = decoder.layers[0]
    for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
        try:
            layer.get_submodule(path)
        except AttributeError:
            raise ValueError(f"permute_llama_channels_: decoder layers of {type(model).__name__} have no "
                             f"{path!r}; only Llama-style module names are supported") from None
    for name, param in model.named_parameters():
        if param.is_meta or type(param.data) is not torch.Tensor:
            raise ValueError(f"permute_llama_channels_ works on a float model with real weights; {name} is "
                             f"{'on the meta device' if param.is_meta else type(param.data).__name__}: "
                             f"permute before quantizing, after loading the weights")
    return decoder, config
