"""Calibration: GPTQ and AWQ choose int4 codes and scales from a few batches of real activations.

Run: python tutorials/02_calibration.py   (CPU; a small random-weight LLaMA; about 6 s on 2 cores)

Round-to-nearest quantizes each weight on its own; GPTQ and AWQ look at what the Linear's inputs actually are and
choose the codes (GPTQ) or per-channel scales (AWQ) that keep the layer's *outputs* close. The result is ordinary
int4 layout data: the same kernels, checkpoints and torch.compile path as round-to-nearest.
"""
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchqkit as qk

torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
float_model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    # Real LLMs have a few hidden channels far larger than the rest (outliers), which is what calibration
    # exploits; random weights have none, so give the norms in front of the Linears a few wide channels.
    for name, p in float_model.named_parameters():
        if name.endswith("layernorm.weight"):
            p[torch.randperm(128)[:6]] = 12.0

# Calibration data: a few batches of token ids (a real run uses a few hundred sequences of the target domain).
batches = [torch.randint(0, 512, (1, 64)) for _ in range(8)]
held_out = torch.randint(0, 512, (2, 64))
with torch.no_grad():
    ref = float_model(held_out).logits


def logits_error(model) -> float:
    with torch.no_grad():
        return ((model(held_out).logits - ref).norm() / ref.norm()).item()


int4 = qk.Int4WeightOnlyConfig(group_size=64)
results = {}
for name, config, data in [("round-to-nearest", int4, None),
                           ("GPTQ", qk.GPTQConfig(int4), batches),
                           ("AWQ", qk.AWQConfig(int4), batches)]:
    model = copy.deepcopy(float_model)
    # The decoder blocks run one at a time on the previous quantized block's outputs; progress goes to stderr.
    report = qk.quantize_(model, config, calibration_data=qk.CalibrationData(data, progress=False) if data else None)
    results[name] = logits_error(model)
    print(f"{name:17s} {len(report.quantized)} Linears quantized, relative logits error {results[name]:.4f}")

assert results["GPTQ"] < results["round-to-nearest"] and results["AWQ"] < results["round-to-nearest"]
print("GPTQ / RTN error: {:.2f}x, AWQ / RTN: {:.2f}x".format(results["GPTQ"] / results["round-to-nearest"],
                                                             results["AWQ"] / results["round-to-nearest"]))
