"""calibration --memory: peak resident memory and wall time of GPTQ's block-by-block run (int4-wo-g128+gptq), on the
group's LLM and on a LLaMA of about 1B parameters with random weights (TinyLlama-1.1B's shape)."""
from __future__ import annotations

import gc
import time

import torch

import torchqkit as qk

from .common.configs import build
from .common.rss import SampledPeak

CONFIG = "int4-wo-g128+gptq"


def synthetic_llama_1b():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.no_grad():
        return LlamaForCausalLM(config).eval()


def measure(rec, name: str, model, batches, config: str) -> None:
    shape = {"model": name, "params": sum(p.numel() for p in model.parameters()),
             "calibration": f"{len(batches)} x {batches[0].shape[1]} tokens"}
    start = time.perf_counter()
    with SampledPeak() as peak:
        report = qk.quantize_(model, qk.ModuleConfigs({"lm_head": None, "_default": build(config)}),
                              calibration_data=batches)
    wall = time.perf_counter() - start
    float_mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    rec.add("GPTQ memory", config, shape, "peak RSS increase", (peak.peak - peak.start) / 1e6, "MB",
            rss_before_mb=peak.start / 1e6, float32_mb=float_mb, quantized=len(report.quantized))
    rec.add("GPTQ memory", config, shape, "wall time", wall, "s")


def run(args, rec, model_llm, batches) -> None:
    config = CONFIG if not args.quick else "int4-wo-g32+gptq"  # the tiny model's K = 64 has no group of 128
    measure(rec, model_llm.name, model_llm.model, batches, config)
    if args.quick:
        return
    gc.collect()
    g = torch.Generator().manual_seed(0)
    measure(rec, "random LLaMA, TinyLlama-1.1B shape", synthetic_llama_1b(),
            [torch.randint(0, 32000, (1, 256), generator=g) for _ in range(4)], config)
