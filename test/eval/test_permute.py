"""permute_llama_channels_ reorders hidden, intermediate and value-head channels of a tiny random Llama
without changing its logits (tied and untied output layers, with and without biases)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchqkit as qk
from torchqkit.eval import permute_llama_channels_

from ..common import sqnr

from .models import tiny_llama

pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tied, bias", [(True, False), (False, True)])
@torch.no_grad()
def test_logits_unchanged_and_weights_moved(tied, bias):
    model = tiny_llama(96, tied=tied, bias=bias)
    before = model(IDS).logits
    weights = {name: p.clone() for name, p in model.named_parameters()}
    perms = permute_llama_channels_(model, seed=5)
    torch.testing.assert_close(model(IDS).logits, before, rtol=1e-5, atol=1e-5)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    layer = model.model.layers[1]
    hidden, inner, value = perms["hidden"], perms["layers.1.mlp"], perms["layers.1.v"]
    assert not torch.equal(hidden, torch.arange(32)) and not torch.equal(inner, torch.arange(48))
    assert value.shape == (2, 8)        # 2 KV heads of head_dim 32 / 4 = 8
    w = "model.layers.1"
    torch.testing.assert_close(layer.mlp.gate_proj.weight, weights[f"{w}.mlp.gate_proj.weight"][inner][:, hidden],
                               rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.down_proj.weight, weights[f"{w}.mlp.down_proj.weight"][hidden][:, inner],
                               rtol=0, atol=0)
    # q and k keep their output (head-dim) order: RoPE pairs fixed channels.
    torch.testing.assert_close(layer.self_attn.q_proj.weight, weights[f"{w}.self_attn.q_proj.weight"][:, hidden],
                               rtol=0, atol=0)
    v_rows = torch.cat([value[0], 8 + value[1]])
    torch.testing.assert_close(layer.self_attn.v_proj.weight, weights[f"{w}.self_attn.v_proj.weight"][v_rows][:, hidden],
                               rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(layer.self_attn.o_proj.bias, weights[f"{w}.self_attn.o_proj.bias"][hidden],
                                   rtol=0, atol=0)


def _rtn_uint4_g8(weight: torch.Tensor) -> torch.Tensor:
    return qk.quantize_weight(weight.detach(), qk.qdtypes.uint4, qk.PerGroup(8), qk.PlainLayout(),
                              mapping=qk.MappingType.ASYMMETRIC, zero_point_domain=qk.ZeroPointDomain.FLOAT
                              ).dequantize()


@torch.no_grad()
def test_breaks_a_group_wise_grid():
    # The GGUF trap in small: up_proj on an asymmetric uint4 grid with groups of 8 along K (each group
    # holds codes 0 and 15, as Q4_1 does), so RTN at the same groups gives it back exactly; after the
    # permutation each group mixes channels of several grids and RTN has real error.
    model = tiny_llama(96)
    up = model.model.layers[0].mlp.up_proj
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 32), generator=gen).float()
    codes[:, 0::8], codes[:, 1::8] = 0, 15
    scale = (torch.rand(48, 4, generator=gen) * 0.05 + 0.01).repeat_interleave(8, dim=1)
    low = (-torch.rand(48, 4, generator=gen) * 0.3).repeat_interleave(8, dim=1)
    up.weight.copy_(codes * scale + low)
    assert sqnr(up.weight, _rtn_uint4_g8(up.weight)) > 100
    permute_llama_channels_(model)
    assert sqnr(up.weight, _rtn_uint4_g8(up.weight)) < 40


def test_refuses_other_models_and_quantized_weights():
    with pytest.raises(ValueError, match="Llama-style causal LM"):
        permute_llama_channels_(nn.Linear(4, 4))
    model = tiny_llama(96)
    qk.quantize_(model, qk.ModuleConfigs({"lm_head": None, "_default": qk.Int8WeightOnlyConfig()}))
    with pytest.raises(ValueError, match="permute before quantizing"):
        permute_llama_channels_(model)
