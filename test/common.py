"""Shared test helpers: SQNR, the SQNR threshold table, small models with realistic module names, what a compiled
graph's code calls, which ops run (OpLog), and a quantized model's float twin (dequantized_copy)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchqkit import AffineQuantizedTensor


@pytest.fixture(autouse=True)
def one_torch_thread():
    """For the folders of tests on models of a few thousand parameters (their conftest.py imports this): a second
    thread only adds synchronization, and on a busy 2-core host OpenMP's waits made each forward pass about 100x
    slower (0.35 s vs 2 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - out|)."""
    ref, out = ref.double(), out.double()
    noise = (ref - out).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(ref.norm() / noise))


# Quantized-vs-float SQNR floors (dB) for the test models below, keyed by config name.
# Random Gaussian weights are the hard case (no outliers to exploit); values sit a few dB under what
# the formats give, so a real regression fails but seeds don't. 4-bit ~ 6 dB/bit * 4 - loss of group
# statistics; int8 ~ 40+ dB (torchao uses >= 40 for per-row int8 and >= 18 for int4 g128).
SQNR_FLOORS_DB = {
    "Int8WeightOnlyConfig": 38.0,
    "Int4WeightOnlyConfig": 18.0,
    "IntxWeightOnlyConfig": 14.0,
    "Int8DynamicActivationInt8WeightConfig": 33.0,
    "Int8DynamicActivationIntxWeightConfig": 14.0,
    "Float8WeightOnlyConfig": 25.0,
    "Float8DynamicActivationFloat8WeightConfig": 22.0,
    "Float8StaticActivationFloat8WeightConfig": 20.0,
    "Int8StaticActivationInt8WeightConfig": 20.0,
    # 4-bit activations without a rotation (measured 15.0 / 17.1 dB on the mlp / transformer): rotate_ is what
    # makes them usable on an LLM (benchmarks rotation)
    "Int4DynamicActivationInt4WeightConfig": 13.0,
    "Float8DynamicActivationInt4WeightConfig": 18.0,  # measured 20.8 / 22.2 dB
}


class MLP(nn.Module):
    def __init__(self, dim=128, hidden=256, out=64):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, out, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """Module names like a LLaMA checkpoint: layers.0.attn.q_proj, layers.1.mlp.down_proj, lm_head."""

    def __init__(self, dim=128, heads=4, hidden=256, n_layers=2, vocab=96):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(n_layers))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return (MLP() if kind == "mlp" else TinyTransformer()).eval()


def model_input(kind: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((5, 128) if kind == "mlp" else (2, 7, 128), generator=g)


def op_calls(code: str, op: str) -> int:
    """Calls of torchqkit::`op` in compiled code (run_and_get_code): inductor's Python wrapper or its C++ one (the
    lean decode loop's default on CPU, Note [Lean decode] in torchqkit/eval/decode.py)."""
    return (code.count(f"torch.ops.torchqkit.{op}.default(")
            + code.count(f'aoti_torch_call_dispatcher("torchqkit::{op}"')
            + code.count(f'findSchemaOrThrow("torchqkit::{op}"'))  # the C++ wrapper's boxed call (list arguments)


# A float matmul in compiled code, in either wrapper.
FLOAT_MM_CALLS = ("extern_kernels.mm(", "extern_kernels.addmm(", "aoti_torch_cpu_mm_out(", "aoti_torch_cpu_addmm_out(")


def small_hf_llama(seed: int = 0, init_std: float | None = 0.2):
    """transformers' LlamaForCausalLM at widths every layout takes (hidden 64, intermediate 160, 2 layers, 4 query /
    2 KV heads, tied 128-token embeddings), seeded; matrices drawn with std ``init_std`` (larger than transformers'
    0.02, so logits depend on every weight), or transformers' own init with None."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, init_std)
    return model


class OpLog(TorchDispatchMode):
    """The ops (overload packets) dispatched while active, in order: their names ("linear_int4wo_tiled"), or with
    ``qualified=True`` namespace and name ("torchqkit_triton.linear_int4wo_tiled"), to tell backends apart."""

    def __init__(self, qualified: bool = False):
        super().__init__()
        self.ops, self.qualified = [], qualified

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket) if self.qualified else func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def dequantized_copy(model: nn.Module) -> nn.Module:
    """The same model with every quantized weight (Linear, expert stack, convolution, embedding) replaced by its
    dequantize(): the float model the quantized one must compute, the reference of the kernels."""
    float_model = copy.deepcopy(model)
    with torch.no_grad():
        for module in float_model.modules():
            for attr, p in list(module._parameters.items()):
                if isinstance(p, AffineQuantizedTensor):
                    w = p.dequantize()
                    if isinstance(module, (nn.Conv1d, nn.Conv2d)):  # stored (out, in): Note [Weight-bearing modules]
                        w = w.reshape(w.shape[0], w.shape[1], *module.kernel_size)
                    setattr(module, attr, nn.Parameter(w, requires_grad=False))
    return float_model

