"""plan_quantize is quantize_'s first phase alone (nothing changes); every config's WeightRecipe quantizes as its
handler does."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.api.configs import recipe_for
from torchqkit.api.quantize import plan_quantize
from test.common import MLP


def test_plan_quantize_touches_nothing_and_reports_what_quantize_does():
    torch.manual_seed(0)
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = qk.ModuleConfigs({"down": None, "_default": qk.Int4WeightOnlyConfig(group_size=32)})
    report, swaps = plan_quantize(model, config)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and type(model.up.weight) is torch.nn.Parameter
    assert [[h.fqn for h in s.holders] for s in swaps] == [["up"]]
    done = qk.quantize_(model, config)
    assert [(e.fqn, e.status, e.bytes_after) for e in report.entries] == [(e.fqn, e.status, e.bytes_after)
                                                                         for e in done.entries]
    assert torch.equal(swaps[0].weight.dequantize(), model.up.weight.dequantize())


def test_recipe_for_a_non_config_names_the_known_configs():
    with pytest.raises(TypeError, match="No handler for str; known configs"):
        recipe_for("int4")


@pytest.mark.parametrize("config", [qk.Int4WeightOnlyConfig(group_size=64, algorithm="hqq"),
                                    qk.NF4WeightOnlyConfig(double_quant=True),
                                    qk.Float8DynamicActivationFloat8WeightConfig(), qk.MXFP4WeightOnlyConfig()],
                         ids=lambda c: type(c).__name__)
def test_recipe_quantizes_like_the_configs_handler(config):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    a = recipe_for(config).quantize(w, "w")
    b = qk.api.configs.handler_for(config)(config, w, "w")
    assert torch.equal(a.dequantize(), b.dequantize()) and a.act_quant == b.act_quant
