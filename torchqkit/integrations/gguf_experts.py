"""GGUF mixture-of-experts tensors: llama.cpp's ``ffn_*_exps`` 3-d tensors <-> transformers' expert Parameters.

Note [GGUF expert tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~
llama.cpp stores a MoE layer's experts as three 3-d tensors, ggml dims (K, N, E), i.e. (E, N, K) in PyTorch
order: ``blk.L.ffn_gate_exps`` and ``blk.L.ffn_up_exps`` (E, I, H) and ``blk.L.ffn_down_exps`` (E, H, I), plus the
router ``blk.L.ffn_gate_inp`` (E, H). transformers 5.x keeps gate and up fused: ``experts.gate_up_proj`` (E, 2I, H),
whose forward takes ``.chunk(2, dim=-1)`` of the product, so rows 0..I-1 of each expert are the gate and I..2I-1
the up projection. An ``ExpertSlot`` says which equal share of each expert's rows a GGUF tensor is.

A quantized stack (Note [Expert weights]) is written with the same encoder as a 2-d weight, expert by expert, and
every expert in one GGML type (the first type that holds all experts' codes; ggml has one type per tensor). GGUF
blocks run along K inside a row, so gate and up are the encoded rows split in two: no value is re-rounded. Reading,
each tensor's blocks decode into the layout the dense types map to, gate and up rows are joined, and each expert is
packed on its own and stacked. Both files are the architectures llama.cpp names: Qwen3-MoE as ``qwen3moe``,
Mixtral as ``llama`` with ``llama.expert_count`` (as llama.cpp's converter writes it).
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ..api.expert_weights import expert_parameters
from ..api.report import LayerReport
from ..layouts.base import WeightFormat
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from ..tensor.experts import stack_experts
from .gguf_blocks import BLOCK_FORMATS, decode_blocks

__all__ = ["ExpertSlot", "expert_slots", "is_moe_file", "moe_config", "load_expert_stack", "FUSED_PARTS"]

# transformers' expert Parameter -> the per-expert projections it holds, in row order (llama.cpp's names).
FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",), "up_proj": ("up_proj",)}


class ExpertSlot(NamedTuple):
    hf_name: str     # the 3-d Parameter, e.g. model.layers.0.mlp.experts.gate_up_proj
    index: int       # which of ``count`` equal row blocks of each expert the GGUF tensor holds
    count: int

    def rows(self, n: int) -> slice:
        share = n // self.count
        return slice(self.index * share, (self.index + 1) * share)


def expert_slots(table, model) -> dict[str, ExpertSlot]:
    """GGUF tensor name -> ExpertSlot for every 3-d expert Parameter gguf-py's name table knows."""
    slots = {}
    for p in expert_parameters(dict(model.named_modules())):
        parts = FUSED_PARTS.get(p.attr, ())
        for i, part in enumerate(parts):
            base = table.get_name(f"{p.module_fqn}.{part}")
            if base is not None:
                slots[f"{base}.weight"] = ExpertSlot(p.fqn, i, len(parts))
    return slots


def is_moe_file(field, arch: str) -> bool:
    return arch == "qwen3moe" or bool(field(f"{arch}.expert_count"))


def moe_config(field, arch: str, tensors: dict, transformers):
    """The transformers config of a qwen3moe / Mixtral (``llama`` with experts) file, from its metadata (checked
    by check_hyperparameters first). llama.cpp renormalizes the top-k routing weights of both."""
    def get(key, default=None):
        value = field(f"{arch}.{key}")
        return default if value is None else value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    common = dict(vocab_size=tensors["token_embd.weight"][0], hidden_size=hidden,
                  num_hidden_layers=get("block_count"), num_attention_heads=heads,
                  num_key_value_heads=get("attention.head_count_kv", heads),
                  num_experts_per_tok=get("expert_used_count"), rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
                  max_position_embeddings=get("context_length", 4096),
                  rope_parameters={"rope_theta": float(get("rope.freq_base", 10000.0)), "rope_type": "default"},
                  tie_word_embeddings="output.weight" not in tensors)
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            **common, head_dim=get("attention.key_length", get("rope.dimension_count", hidden // heads)),
            intermediate_size=get("feed_forward_length"), moe_intermediate_size=get("expert_feed_forward_length"),
            num_experts=get("expert_count"), norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return transformers.MixtralConfig(**common, head_dim=get("rope.dimension_count", hidden // heads),
                                      intermediate_size=get("feed_forward_length"),
                                      num_local_experts=get("expert_count"), sliding_window=None)


def _raw(tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # the memory map is read-only and nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(tensor.data))


def _float_rows(tensor, shape) -> torch.Tensor:
    from .gguf import _FLOAT_TYPES
    type_name = tensor.tensor_type.name
    if type_name in _FLOAT_TYPES:
        return _raw(tensor).view(_FLOAT_TYPES[type_name]).reshape(shape).float()
    from gguf.quants import dequantize
    return torch.from_numpy(dequantize(np.asarray(tensor.data), tensor.tensor_type)).reshape(shape).float()


def load_expert_stack(model, hf_name: str, tensors: list, path, error) -> LayerReport:
    """The GGUF tensors of one expert Parameter (in slot order) into it: a quantized stack when every part is a
    block type torchqkit has a layout for and all decode to one format, else float32 (the reason reported)."""
    module_name, _, attr = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    shapes = [tuple(int(s) for s in reversed(t.shape.tolist())) for t in tensors]   # (E, N_part, K) each
    e, k = shapes[0][0], shapes[0][2]
    nbytes = sum(int(t.n_bytes) for t in tensors)
    types = [t.tensor_type.name for t in tensors]
    decoded = []
    if all(ty in BLOCK_FORMATS for ty in types):
        decoded = [decode_blocks(BLOCK_FORMATS[ty], _raw(t).reshape(s[0] * s[1], -1), k)
                   for t, ty, s in zip(tensors, types, shapes)]
    if decoded and len({d[0] for d in decoded}) == 1:
        fmt = decoded[0][0]
        joined = [None if decoded[0][1][i] is None else
                  torch.cat([d[1][i].reshape(e, s[1], -1) for d, s in zip(decoded, shapes)], dim=1)
                  for i in range(len(decoded[0][1]))]
        experts = []
        for x in range(e):
            parts = type(decoded[0][1])(*(None if j is None else j[x].contiguous() for j in joined))
            wfmt = WeightFormat.of(fmt.qdtype, (1, fmt.group), parts.qdata.shape, fmt.zero_point_domain)
            layout = fmt.layout().for_weight(wfmt)
            weight = AffineQuantizedTensor(layout.pack(parts, wfmt), fmt.qdtype, (1, fmt.group),
                                           tuple(parts.qdata.shape), torch.float32, layout, fmt.zero_point_domain)
            problem = weight.qparams_problem()
            if problem is not None:
                raise error(f"{path}: tensor {tensors[0].name!r} ({types[0]}), expert {x}: block scales or mins are "
                            f"NaN or Inf ({problem}); the file is corrupt (llama.cpp would compute NaN from it)")
            experts.append(weight)
        stack = stack_experts(experts, hf_name)
        setattr(module, attr, nn.Parameter(stack, requires_grad=False))
        names = " + ".join(t.name for t in tensors)
        return LayerReport(hf_name, "quantized", f"gguf {'/'.join(dict.fromkeys(types))} -> {fmt.describe()}",
                           f"{e} experts from {names}", nbytes, stack.packed_nbytes())
    value = torch.cat([_float_rows(t, s) for t, s in zip(tensors, shapes)], dim=1)
    setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))
    quantized = [ty for ty in types if ty not in ("F32", "F16", "BF16")]
    if not quantized:
        how, reason = f"{'/'.join(dict.fromkeys(types))} -> float32", f"{'/'.join(dict.fromkeys(types))} -> float32"
    else:
        how = f"dequantized {'/'.join(dict.fromkeys(types))} -> float32"
        reason = (f"{'/'.join(types)}: no torchqkit layout for this GGUF type" if not decoded else
                  f"{' and '.join(t.name for t in tensors)} decode to different formats ({', '.join(types)}); one "
                  f"quantized stack needs one format")
    return LayerReport(hf_name, "kept", how, reason, nbytes, value.numel() * value.element_size())
