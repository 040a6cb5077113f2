"""2:4 sparsity: magnitude pruning, Wanda and SparseGPT, with float values and with int4 g32 codes on top, by
SmolLM2-135M perplexity and all-MiniLM-L6-v2 embedding cosine, with the quality targets as ratios of losses.

    python -m benchmarks sparsity                     # SmolLM2 (1024 tokens, 32 x 256 calibration tokens) + MiniLM
    python -m benchmarks sparsity --tokens 512 --calib-batches 16 --no-minilm
    python -m benchmarks sparsity --quick             # a tiny random LLaMA: checks the code only

SmolLM2: the GGUF dequantized to float32, channels permuted first (its Linears sit on a Q4_1 grid otherwise, so
int4 g32 round-to-nearest would be lossless: docs/platform.md), every Linear but the tied lm_head pruned; perplexity
over tokens [0, --tokens) of the text torchqkit ships in windows of 512; calibration (Wanda, SparseGPT) on
--calib-batches windows of 256 tokens from token 8192 on (text the perplexity never reads). MiniLM: all 37 Linears,
calibrated on the last 64 packaged demo sentences, 1 - cosine of each other sentence's embedding to the float32 one
(mean). A config's loss is its perplexity increase over float32 (SmolLM2) or its 1 - cos (MiniLM). Targets: SparseGPT's
loss <= 0.6 x magnitude pruning's, Wanda's <= 0.75 x; with int4 g32 on top, SparseGPT + int4 below magnitude + int4
round-to-nearest. Bits per weight: stored bytes (kept codes or values, positions, scales) over the pruned Linears'
weights. Quality only, no timings. The committed run: benchmarks/sparsity_results.md.
"""
from __future__ import annotations

import copy
import sys

import torch

import torchqkit as qk
from torchqkit.eval import eval_text, permute_llama_channels_, perplexity

from .common import cli, llm
from .common.configs import build
from .common.loss_table import embedding_losses, loss_table

GROUP = "sparsity"
DEFAULT_CONFIGS = ["float32", "sparse-2of4", "sparse-2of4+wanda", "sparse-2of4+sparsegpt", "int4-wo-g32",
                   "int4-wo-g32+2of4", "int4-wo-g32+2of4+wanda", "int4-wo-g32+2of4+sparsegpt"]
# (config, its reference, the largest allowed loss ratio)
TARGETS = [("sparse-2of4+sparsegpt", "sparse-2of4", 0.6), ("sparse-2of4+wanda", "sparse-2of4", 0.75),
           ("int4-wo-g32+2of4+sparsegpt", "int4-wo-g32+2of4", 1.0, True)]  # True: strictly below
CALIB_START, CALIB_WINDOW = 8192, 256


def _quantize(model, name: str, keep: str | None, batches):
    q = copy.deepcopy(model)
    config = build(name)
    if config is None:
        return q, None
    configs = qk.ModuleConfigs({keep: None, "_default": config}) if keep else config
    report = qk.quantize_(q, configs, calibration_data=batches if config.needs_calibration_data() else None)
    weights = [q.get_submodule(e.fqn).weight for e in report.quantized]
    bits = 8 * sum(w.packed_nbytes() for w in weights) / sum(w.numel() for w in weights)
    return q, bits


def smollm2_losses(args) -> dict[str, tuple[float, float, float | None]]:
    model_llm = llm.load(args.quick)
    ids = model_llm.tokenize(eval_text())
    with torch.no_grad():
        permute_llama_channels_(model_llm.model, seed=0)
    window = 32 if args.quick else CALIB_WINDOW
    batches = [ids[CALIB_START + i * window: CALIB_START + (i + 1) * window].unsqueeze(0)
               for i in range(args.calib_batches)]
    ids = ids[:args.tokens]
    ppl, out = {}, {}
    for name in args.configs:
        print(f"[sparsity] {model_llm.name} {name}", file=sys.stderr, flush=True)
        q, bits = _quantize(model_llm.model, name, "lm_head", batches)
        ppl[name] = perplexity(q, ids, min(512, args.tokens), progress=False)
        out[name] = (ppl[name], ppl[name] - ppl["float32"], bits)
        del q
    return out


def minilm_losses(args) -> dict[str, tuple[float, float, float | None]]:
    from torchqkit.demo import load_model, load_sentences
    model = load_model()
    sentences = load_sentences()
    calib, evaluate = sentences[-64:], sentences[:-64]
    batches = [(dict(model.tokenizer(calib[i:i + 16], padding=True, truncation=True, return_tensors="pt")),)
               for i in range(0, len(calib), 16)]
    return embedding_losses(model, args.configs, evaluate, lambda m, name: _quantize(m, name, None, batches), GROUP)


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--tokens", type=int, default=1024, help="SmolLM2 tokens scored (default 1024)")
    p.add_argument("--calib-batches", type=int, default=32, help="calibration windows of 256 tokens (default 32)")
    p.add_argument("--no-minilm", action="store_true", help="SmolLM2 rows only")
    p.set_defaults(threads=1)
    args, rec = cli.start(GROUP, p, argv)
    cli.quick(args, argv, tokens=128, calib_batches=2, no_minilm=True)
    if "float32" not in args.configs:
        args.configs = ["float32", *args.configs]
    smol = smollm2_losses(args)
    shape = {"tokens": args.tokens, "permuted": True, "calibration": f"{args.calib_batches} x "
             f"{32 if args.quick else CALIB_WINDOW}"}
    for name, (value, loss, bits) in smol.items():
        rec.add("SmolLM2 perplexity", name, shape, "perplexity", value, "", increase=loss, bits_per_weight=bits)
    model_name = "a tiny random LLaMA (--quick)" if args.quick else "SmolLM2-135M"
    title = f"{model_name}, {args.tokens} tokens, channels permuted, calibration {shape['calibration']} tokens"
    lines = loss_table(title, "perplexity", smol, TARGETS)
    if not args.no_minilm:
        mini = minilm_losses(args)
        for name, (value, _, bits) in mini.items():
            rec.add("MiniLM cosine", name, {}, "1 - cos (mean)", value, "", bits_per_weight=bits)
        lines += loss_table("all-MiniLM-L6-v2, the packaged demo sentences (calibration: the last 64)",
                            "1 - cos (mean)", mini, TARGETS)
    print("\n".join(lines))
    return 0
