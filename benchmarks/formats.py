"""The float formats side by side: NVFP4 and MXFP4 (4-bit floats), FP6 e3m2 / e2m3, int4 g128 round-to-nearest, by
SmolLM2-135M perplexity and all-MiniLM-L6-v2 embedding cosine, with the two targets as ratios of quality losses.

    python -m benchmarks formats                      # SmolLM2 (2048 tokens) + MiniLM; prints a markdown table
    python -m benchmarks formats --tokens 512 --no-minilm
    python -m benchmarks formats --quick              # a tiny random LLaMA, 128 tokens: checks the code only

SmolLM2: the GGUF dequantized to float32, channels permuted first (Note: its Linears sit on a Q4_1 grid otherwise,
docs/platform.md), every Linear but the tied lm_head quantized, perplexity over tokens [0, --tokens) of the text
torchqkit ships in windows of 512. MiniLM: all 37 Linears, 1 - cosine of each packaged demo sentence's embedding to
the float32 one (mean). The loss of a config is its perplexity increase over float32 (SmolLM2) or its 1 - cos
(MiniLM); the targets: NVFP4's loss <= MXFP4's (both about 4.5 bits per weight), FP6's loss <= 0.3 x int4 g128's.
Bits per weight count codes and scales (the stored bytes) over the quantized Linears. Quality only: no timings.
The committed run: benchmarks/formats_results.md.
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

GROUP = "formats"
DEFAULT_CONFIGS = ["float32", "int4-wo-g128", "mxfp4", "nvfp4", "fp6-e3m2", "fp6-e2m3", "fp6-e2m3+g32",
                   "nvfp4-dyn-nvfp4"]
# (config, its reference, the largest allowed loss ratio): the targets.
TARGETS = [("nvfp4", "mxfp4", 1.0), ("fp6-e3m2", "int4-wo-g128", 0.3), ("fp6-e2m3", "int4-wo-g128", 0.3),
           ("fp6-e2m3+g32", "int4-wo-g128", 0.3)]
QUICK_CONFIGS = ["float32", "mxfp4", "nvfp4", "fp6-e2m3"]  # the tiny model's K = 64 has no group of 128


def _quantize(model, name: str, keep: str | None):
    q = copy.deepcopy(model)
    config = build(name)
    if config is None:
        return q, None
    report = qk.quantize_(q, qk.ModuleConfigs({keep: None, "_default": config}) if keep else config)
    weights = [q.get_submodule(e.fqn).weight for e in report.quantized]
    bits = 8 * sum(w.packed_nbytes() for w in weights) / sum(w.numel() for w in weights)
    return q, bits


def smollm2_losses(args) -> dict[str, tuple[float, float | None]]:
    model_llm = llm.load(args.quick)
    ids = model_llm.tokenize(eval_text())[:args.tokens]
    with torch.no_grad():
        permute_llama_channels_(model_llm.model, seed=0)
    ppl, out = {}, {}
    for name in args.configs:
        print(f"[formats] {model_llm.name} {name}", file=sys.stderr, flush=True)
        q, bits = _quantize(model_llm.model, name, "lm_head")
        ppl[name] = perplexity(q, ids, min(512, args.tokens), progress=False)
        out[name] = (ppl[name], ppl[name] - ppl["float32"], bits)
        del q
    return out


def minilm_losses(args) -> dict[str, tuple[float, float | None]]:
    from torchqkit.demo import load_model, load_sentences
    model = load_model()
    return embedding_losses(model, args.configs, load_sentences(), lambda m, name: _quantize(m, name, None), GROUP)


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--tokens", type=int, default=2048, help="SmolLM2 tokens scored (default 2048)")
    p.add_argument("--no-minilm", action="store_true", help="SmolLM2 rows only")
    p.set_defaults(threads=1)
    args, rec = cli.start(GROUP, p, argv)
    cli.quick(args, argv, tokens=128, configs=QUICK_CONFIGS, no_minilm=True)
    if "float32" not in args.configs:
        args.configs = ["float32", *args.configs]
    lines = []
    smol = smollm2_losses(args)
    for name, (value, loss, bits) in smol.items():
        rec.add("SmolLM2 perplexity", name, {"tokens": args.tokens, "permuted": True}, "perplexity", value, "",
                increase=loss, bits_per_weight=bits)
    model_name = "a tiny random LLaMA (--quick)" if args.quick else "SmolLM2-135M"
    lines += loss_table(f"{model_name}, {args.tokens} tokens, channels permuted", "perplexity", smol, TARGETS)
    if not args.no_minilm:
        mini = minilm_losses(args)
        for name, (value, _, bits) in mini.items():
            rec.add("MiniLM cosine", name, {}, "1 - cos (mean)", value, "", bits_per_weight=bits)
        lines += loss_table("all-MiniLM-L6-v2, the packaged demo sentences", "1 - cos (mean)", mini, TARGETS)
    print("\n".join(lines))
    return 0
