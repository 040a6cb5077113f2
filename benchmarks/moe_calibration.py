"""GPTQ of mixture-of-experts expert Parameters against round-to-nearest, on a random-weight Qwen3-MoE.

    python -m benchmarks moe_calibration --threads 1           # 4 layers, 32 experts (top-4), hidden 256
    python -m benchmarks moe_calibration --quick               # the 2-layer test model: checks the code only

No MoE checkpoint ships with the machine (SmolLM2 and MiniLM are dense), so the model has random weights
(transformers' own initialization, seed 0) and the tokens are random: the figures say how much of the experts'
rounding error GPTQ removes on the tokens it saw and on others, not what a trained MoE's perplexity does. Only the
expert Parameters are quantized (attention, routers and lm_head stay float), int4 with groups of 32 or 128.
Metrics against the float model: logits SQNR (dB, higher is better) on the calibration batches and on held-out
batches, the MSE of the first layer's MoE block output (its input is the same for every row) on each, and how many
(layer, Parameter, expert) triples got no calibration token and were rounded to nearest.
"""
from __future__ import annotations

import copy
import math
import re

import torch

import torchqkit as qk

from .common import cli

GROUP = "moe_calibration"
FALLBACK = re.compile(r"experts? ([\d, ]+) of \d+ of \S+ got no calibration tokens")  # the report's wording
SIZES = {False: dict(hidden_size=256, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                     num_hidden_layers=4, vocab_size=512, batches=16, held_out=4, tokens=256),
         True: dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    num_hidden_layers=2, vocab_size=128, batches=2, held_out=2, tokens=32)}


def _model(size: dict) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=size["vocab_size"], hidden_size=size["hidden_size"],
                            intermediate_size=2 * size["hidden_size"], moe_intermediate_size=size["moe_intermediate_size"],
                            num_experts=size["num_experts"], num_experts_per_tok=size["num_experts_per_tok"],
                            num_hidden_layers=size["num_hidden_layers"], num_attention_heads=4, num_key_value_heads=2,
                            head_dim=size["hidden_size"] // 4, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3MoeForCausalLM(config).eval()


def _batches(size: dict, seed: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, size["vocab_size"], (1, size["tokens"]), generator=g) for _ in range(count)]


def _outputs(model, batches):
    """(logits, first MoE block output) per batch."""
    moe = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: moe.append(out.detach()))
    try:
        with torch.no_grad():
            logits = [model(b).logits for b in batches]
    finally:
        handle.remove()
    return logits, moe


def _sqnr(outs, refs) -> float:
    signal = sum(r.float().square().sum().item() for r in refs)
    noise = sum((o - r).float().square().sum().item() for o, r in zip(outs, refs))
    return 10 * math.log10(signal / noise)


def _mse(outs, refs) -> float:
    return sum((o - r).square().mean().item() for o, r in zip(outs, refs)) / len(refs)


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    args, rec = cli.start(GROUP, p, argv)
    size = SIZES[args.quick]
    model = _model(size)
    calib, held = _batches(size, 1, size["batches"]), _batches(size, 2, size["held_out"])
    refs = {"calibration": _outputs(model, calib), "held-out": _outputs(model, held)}
    shape = {k: size[k] for k in ("hidden_size", "num_experts", "num_experts_per_tok", "num_hidden_layers")}
    shape["calibration tokens"] = size["batches"] * size["tokens"]
    for group in (32, 128):
        base = qk.Int4WeightOnlyConfig(group_size=group)
        for name, config in ((f"int4-wo-g{group}", base), (f"int4-wo-g{group}+gptq", qk.GPTQConfig(base))):
            q = copy.deepcopy(model)
            report = qk.quantize_(q, qk.ModuleConfigs({"re:.*experts.*": config, "_default": None}),
                                  calibration_data=calib if "gptq" in name else None, strict=True)
            fallback = sum(len(m.group(1).split(", ")) for e in report.quantized
                           for m in [FALLBACK.search(e.reason)] if m is not None)
            for data, batches in (("calibration", calib), ("held-out", held)):
                logits, moe = _outputs(q, batches)
                rec.add(data, name, shape, "logits SQNR", _sqnr(logits, refs[data][0]), "dB")
                rec.add(data, name, shape, "layer-0 MoE MSE", _mse(moe, refs[data][1]), "")
            rec.add("calibration", name, shape, "RTN-fallback experts", fallback, "")
    rec.print_table()
    return 0
