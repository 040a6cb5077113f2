"""Tiny GPTQ / AWQ checkpoints of a random LLaMA, written from the formats' definitions (not with torchqkit's code),
and the formats' reference dequantizations, written the way AutoGPTQ and AutoAWQ compute them.

GPTQ (AutoGPTQ's QuantLinear, 4-bit): ``qweight`` int32 (K / 8, N): bits 4 j .. 4 j + 3 of qweight[i, n] hold
the code of input 8 i + j of output n; ``qzeros`` int32 (G, N / 8): bits 4 j of qzeros[g, c] hold the zero of
output 8 c + j, minus one (checkpoint_format "gptq"; "gptq_v2" stores the zero itself); ``scales`` float16 (G, N);
``g_idx`` int32 (K,): the group of each input. Dequantized: w[k, n] = scales[g_idx[k], n] (q[k, n] - z[g_idx[k], n])
in float16, with AutoGPTQ's z = (stored + 1) & 15.
AWQ (AutoAWQ's WQLinear_GEMM): ``qweight`` int32 (K, N / 8): bits 4 j of qweight[k, c] hold the code of output
8 c + ORDER[j], ORDER = 0 2 4 6 1 3 5 7; ``qzeros`` (G, N / 8) the same way; ``scales`` float16 (G, N).
Dequantized: (q - z) * s in float16, z and s repeated over the g inputs of each group.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def quantized_linears(model):
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in LINEARS}


def _or_words(fields: np.ndarray, bits: int = 4) -> np.ndarray:
    """(..., 32 / bits) fields -> (...) int32 words, field j at bits bits * j."""
    word = np.zeros(fields.shape[:-1], dtype=np.uint32)
    for j in range(32 // bits):
        word |= fields[..., j].astype(np.uint32) << np.uint32(bits * j)
    return word.view(np.int32)


def rtn_groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int = 4):
    """Asymmetric b-bit RTN codes (N, K) uint8, scales (G, N) float16, zeros (G, N) of a float weight whose input k
    belongs to group g_idx[k]."""
    n, k = w.shape
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    codes = torch.empty(n, k, dtype=torch.int64)
    for gi in range(groups):
        cols = (g_idx == gi).nonzero().flatten()
        lo = w[:, cols].min(dim=1).values.clamp(max=0)
        hi = w[:, cols].max(dim=1).values.clamp(min=0)
        top = 2 ** bits - 1
        s = ((hi - lo) / top).clamp(min=1e-6).half()
        z = torch.round(-lo / s.float()).clamp(0, top).long()
        scales[gi], zeros[gi] = s, z
        codes[:, cols] = (torch.round(w[:, cols] / s.float()[:, None]) + z[:, None]).clamp(0, top).long()
    return codes.to(torch.uint8), scales, zeros


def gptq_tensors(codes, scales, zeros, g_idx, checkpoint_format="gptq", bits=4):
    n, k = codes.shape
    f = 32 // bits
    qweight = _or_words(codes.t().numpy().reshape(k // f, f, n).transpose(0, 2, 1), bits)
    stored = (zeros - 1) & (2 ** bits - 1) if checkpoint_format == "gptq" else zeros
    qzeros = _or_words(stored.numpy().reshape(zeros.shape[0], n // f, f), bits)
    return {"qweight": torch.from_numpy(qweight.copy()), "qzeros": torch.from_numpy(qzeros.copy()),
            "scales": scales.clone(), "g_idx": g_idx.to(torch.int32)}


def gptq_reference(t, checkpoint_format="gptq", bits=4) -> torch.Tensor:
    """AutoGPTQ's dequantization: (N, K) float16."""
    mask = 2 ** bits - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    weight = (t["qweight"].unsqueeze(1) >> shifts.view(1, -1, 1)) & mask        # (K/f, f, N)
    weight = weight.reshape(-1, weight.shape[-1])                                # (K, N)
    zeros = (t["qzeros"].unsqueeze(2) >> shifts.view(1, 1, -1)) & mask           # (G, N/f, f)
    zeros = zeros.reshape(zeros.shape[0], -1)
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & mask
    g = t["g_idx"].long()
    return (t["scales"][g] * (weight - zeros[g]).to(torch.float16)).t().contiguous()


def awq_tensors(codes, scales, zeros):
    n, k = codes.shape
    interleaved = codes.t().numpy().reshape(k, n // 8, 8)[..., ORDER]
    zi = zeros.numpy().reshape(zeros.shape[0], n // 8, 8)[..., ORDER]
    return {"qweight": torch.from_numpy(_or_words(interleaved).copy()),
            "qzeros": torch.from_numpy(_or_words(zi).copy()), "scales": scales.clone()}


def awq_reference(t, group: int) -> torch.Tensor:
    """AutoAWQ's dequantization: (N, K) float16."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    reverse = torch.arange(t["scales"].shape[1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    iw = ((t["qweight"].unsqueeze(-1) >> shifts) & 15).reshape(t["qweight"].shape[0], -1)[:, reverse]
    iz = ((t["qzeros"].unsqueeze(-1) >> shifts) & 15).reshape(t["qzeros"].shape[0], -1)[:, reverse]
    w = (iw - iz.repeat_interleave(group, dim=0)).to(torch.float16) * t["scales"].repeat_interleave(group, dim=0)
    return w.t().contiguous()


def write_checkpoint(directory: Path, model, quantization_config: dict, linear_tensors: dict) -> Path:
    """config.json + model.safetensors: float16 float tensors, each quantized Linear's tensors in its place."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in linear_tensors and name.endswith(".weight"):
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in linear_tensors[module].items()})
        else:
            tensors[name] = p.half().contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(architectures=[type(model).__name__], quantization_config=quantization_config, dtype="float16")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def reference_model(model, weights: dict[str, torch.Tensor]):
    """A float16 copy of ``model`` whose quantized Linears hold the reference dequantized ``weights``."""
    ref = tiny_llama()
    ref.load_state_dict(model.state_dict())
    ref = ref.half()
    for name, w in weights.items():
        ref.get_submodule(name).weight.data = w
    return ref


def gptq_checkpoint(directory: Path, *, act_order=False, checkpoint_format="gptq", group=32, seed=0, bits=4):
    """A GPTQ checkpoint of tiny_llama(seed); returns (directory, float model, reference weights by module)."""
    model = tiny_llama(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    linear, ref = {}, {}
    for name, m in quantized_linears(model).items():
        k = m.in_features
        g_idx = torch.arange(k) // group
        if act_order:  # act-order: group i holds the inputs a permutation puts at positions i g .. i g + g - 1
            g_idx = g_idx[torch.argsort(torch.randperm(k, generator=gen))]
        codes, scales, zeros = rtn_groups(m.weight.detach(), g_idx, k // group, bits)
        linear[name] = gptq_tensors(codes, scales, zeros, g_idx, checkpoint_format, bits)
        ref[name] = gptq_reference(linear[name], checkpoint_format, bits)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
          "checkpoint_format": checkpoint_format}
    return write_checkpoint(directory, model, qc, linear), model, ref, linear


def awq_checkpoint(directory: Path, *, group=32, seed=0):
    model = tiny_llama(seed)
    linear, ref = {}, {}
    for name, m in quantized_linears(model).items():
        k = m.in_features
        codes, scales, zeros = rtn_groups(m.weight.detach(), torch.arange(k) // group, k // group)
        linear[name] = awq_tensors(codes, scales, zeros)
        ref[name] = awq_reference(linear[name], group)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    return write_checkpoint(directory, model, qc, linear), model, ref, linear
