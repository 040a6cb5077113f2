"""Rotations (qk.rotate_, QuaRot-style) and low-bit activations: SmolLM2-135M perplexity of each config without and
with the rotation, the targets as ratios of quality losses, and all-MiniLM-L6-v2 embedding cosine (no rotation:
rotate_ takes LLaMA-family decoders, and MiniLM is a post-LayerNorm BERT).

    python -m benchmarks rotation                       # SmolLM2 (1024 tokens) + MiniLM; prints markdown tables
    python -m benchmarks rotation --tokens 512 --no-minilm
    python -m benchmarks rotation --quick               # a tiny random LLaMA, 128 tokens: checks the code only

SmolLM2: the GGUF dequantized to float32, channels permuted first (its Linears sit on a Q4_1 grid otherwise,
docs/platform.md); the rotated rows start from that model and call ``qk.rotate_(model, RotationConfig(seed=0))``
(residual randomized Hadamard 576, value / o_proj per-head Hadamard 64, down_proj's input Hadamard 1536 online).
Every Linear but the lm_head is quantized (the lm_head stays float in both columns). Perplexity over tokens
[0, --tokens) of the text torchqkit ships in windows of 512; GPTQ (`+gptq`) calibrates on --calib-batches windows of
256 tokens from token 8192 on. The loss of a config is its perplexity increase over float32; the targets: with the
rotation, W4A8 (int8 activations x int4) and W4A4 lose at most 0.5x what they lose without it. MiniLM: all 37
Linears, 1 - cosine of each packaged demo sentence's embedding to the float32 one (mean). Quality only: no timings.
The committed run: benchmarks/rotation_results.md.
"""
from __future__ import annotations

import copy
import sys

import torch

import torchqkit as qk
from torchqkit.eval import eval_text, permute_llama_channels_, perplexity

from .common import cli, llm
from .common.configs import build

GROUP = "rotation"
DEFAULT_CONFIGS = ["float32", "intx4-wo-sym-g32", "intx4-wo-sym-g32+gptq", "int8-dyn-int4-g32",
                   "int8-dyn-int4-g32+gptq", "int8-dyn-int4-g32+per-channel", "int4-dyn-int4-g32",
                   "int4-dyn-int4-g32+gptq", "fp8-dyn-int4-g32", "mxfp8-dyn-mxfp4"]
QUICK_CONFIGS = ["float32", "int8-dyn-int4-g32", "int8-dyn-int4-g32+gptq", "int4-dyn-int4-g32",
                 "int4-dyn-int4-g32+gptq"]
# (config, the largest allowed loss ratio rotated / not rotated): the targets. W4A8 and W4A4 with or without GPTQ.
TARGETS = [("int8-dyn-int4-g32", 0.5), ("int8-dyn-int4-g32+gptq", 0.5), ("int4-dyn-int4-g32", 0.5),
           ("int4-dyn-int4-g32+gptq", 0.5)]
CALIB_START, CALIB_WINDOW = 8192, 256
ROTATION = qk.RotationConfig(seed=0)


def _quantize(model, name: str, batches):
    q = copy.deepcopy(model)
    config = build(name)
    if config is not None:
        calibration = batches if config.needs_calibration_data() else None
        qk.quantize_(q, qk.ModuleConfigs({"lm_head": None, "_default": config}), calibration_data=calibration)
    return q


def _max_relative_logit_change(a, b, ids) -> float:
    with torch.no_grad():
        x, y = a(ids[:256].unsqueeze(0)).logits, b(ids[:256].unsqueeze(0)).logits
    return float((x - y).abs().max() / x.abs().max())


def _massive_channels(model, ids, rec) -> str:
    """Each RMSNorm's input normalized without its weight (what a rotated model's Linears read, Note [Residual
    rotation]): the share of its energy in its largest channel, and that channel's norm weight against the median
    one. Round-to-nearest error is spread evenly over the rotated input's energy; an unrotated Linear sees this
    channel through its norm weight, which the model sometimes keeps near 0."""
    shares, suppressed, hooks = [], 0, []

    def observe(norm):
        def hook(module, inputs, output):
            nonlocal suppressed
            x = inputs[0].float()
            energy = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).pow(2).mean((0, 1))
            j = int(energy.argmax())
            shares.append(float(energy[j] / energy.sum()))
            gamma = module.weight.detach().float().abs()
            suppressed += bool(gamma[j] < 0.01 * gamma.median())
        return hook
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            hooks.append(norm.register_forward_hook(observe(norm)))
    try:
        with torch.no_grad():
            model(ids[:512].unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    shares.sort()
    median = shares[len(shares) // 2]
    rec.add("SmolLM2 massive channel", "float32", {"tokens": min(512, ids.numel()), "norms": len(shares)},
            "largest channel's share of the normalized input energy (median)", median, "",
            min=shares[0], max=shares[-1], weight_below_1pct_of_median=suppressed)
    return (f"Linear inputs before the norm weight (what the rotated Linears read): the largest channel holds "
            f"{shares[0]:.0%}-{shares[-1]:.0%} of the energy (median {median:.0%}) in each of the {len(shares)} "
            f"norms; in {suppressed} of them its norm weight is below 1% of the median one, so the unrotated Linear "
            f"hardly reads it.")


def smollm2_rows(args, rec) -> tuple[list[str], dict]:
    model_llm = llm.load(args.quick)
    ids = model_llm.tokenize(eval_text())
    window = 32 if args.quick else CALIB_WINDOW
    start = 1024 if args.quick else CALIB_START
    batches = [ids[start + i * window: start + (i + 1) * window].unsqueeze(0) for i in range(args.calib_batches)]
    ids = ids[:args.tokens]
    with torch.no_grad():
        permute_llama_channels_(model_llm.model, seed=0)
    massive = _massive_channels(model_llm.model, ids, rec)
    rotated = copy.deepcopy(model_llm.model)
    report = qk.rotate_(rotated, ROTATION)
    change = _max_relative_logit_change(model_llm.model, rotated, ids)
    rec.add("SmolLM2 rotation", "float32", {"tokens": min(256, ids.numel())}, "max |logit change| / max |logit|",
            change, "")
    bases = {"none": model_llm.model, "hadamard": rotated}
    out = {}
    for name in args.configs:
        out[name] = {}
        for rotation, base in bases.items():
            print(f"[rotation] {model_llm.name} {name} rotation={rotation}", file=sys.stderr, flush=True)
            q = _quantize(base, name, batches)
            ppl = perplexity(q, ids, min(512, args.tokens), progress=False)
            out[name][rotation] = ppl
            rec.add("SmolLM2 perplexity", name, {"tokens": args.tokens, "permuted": True, "rotation": rotation},
                    "perplexity", ppl, "", increase=ppl - out["float32"].get(rotation, ppl))
            del q
    title = "a tiny random LLaMA (--quick)" if args.quick else "SmolLM2-135M"
    lines = [f"### {title}, {args.tokens} tokens, channels permuted, lm_head float", "",
             f"{report}", "",
             f"Rotated float32 model: largest logit change {change:.2e} of the largest logit (first "
             f"{min(256, ids.numel())} tokens).", "", massive, ""]
    return lines + _table(out), out


def _table(out: dict) -> list[str]:
    f0, f1 = out["float32"]["none"], out["float32"]["hadamard"]
    lines = ["| config | perplexity | loss | rotated: perplexity | loss | loss ratio |", "|---|---:|---:|---:|---:|---:|"]
    for name, row in out.items():
        loss0, loss1 = row["none"] - f0, row["hadamard"] - f1
        ratio = f"{loss1 / loss0:.3f}" if loss0 > 0 else "-"
        lines.append(f"| {name} | {row['none']:.5g} | {loss0:.4g} | {row['hadamard']:.5g} | {loss1:.4g} | {ratio} |")
    lines += ["", "| target | loss ratio (rotated / not) | bound | met |", "|---|---:|---:|---|"]
    for name, bound in TARGETS:
        if name in out and out[name]["none"] > f0:
            ratio = (out[name]["hadamard"] - f1) / (out[name]["none"] - f0)
            lines.append(f"| {name} | {ratio:.3f} | {bound:g} | {'yes' if ratio <= bound else 'NO'} |")
    return lines + [""]


def minilm_rows(args, rec) -> list[str]:
    from torchqkit.demo import load_model, load_sentences
    model = load_model()
    sentences = load_sentences()
    try:
        qk.rotate_(copy.deepcopy(model[0].auto_model))
        refusal = "rotate_ accepted MiniLM"
    except qk.RotationError as e:
        refusal = str(e)

    def embed(m):
        return m.encode(sentences, batch_size=32, convert_to_tensor=True, normalize_embeddings=True).float()
    reference = embed(model)
    lines = ["### all-MiniLM-L6-v2, the packaged demo sentences (no rotation)", "", f"rotate_ on MiniLM: {refusal}",
             "", "| config | 1 - cos (mean) |", "|---|---:|"]
    for name in args.configs:
        if name == "float32" or build(name).needs_calibration_data():
            continue
        print(f"[rotation] MiniLM {name}", file=sys.stderr, flush=True)
        q = copy.deepcopy(model)
        qk.quantize_(q, build(name))
        loss = float(1 - torch.nn.functional.cosine_similarity(embed(q), reference, dim=-1).mean())
        rec.add("MiniLM cosine", name, {}, "1 - cos (mean)", loss, "")
        lines.append(f"| {name} | {loss:.5g} |")
        del q
    return lines + [""]


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--tokens", type=int, default=1024, help="SmolLM2 tokens scored (default 1024)")
    p.add_argument("--calib-batches", type=int, default=8, help="GPTQ calibration windows of 256 tokens (default 8)")
    p.add_argument("--no-minilm", action="store_true", help="SmolLM2 rows only")
    p.set_defaults(threads=1)
    args, rec = cli.start(GROUP, p, argv)
    cli.quick(args, argv, tokens=128, configs=QUICK_CONFIGS, no_minilm=True, calib_batches=2)
    if "float32" not in args.configs:
        args.configs = ["float32", *args.configs]
    lines, _ = smollm2_rows(args, rec)
    if not args.no_minilm:
        lines += minilm_rows(args, rec)
    print("\n".join(lines))
    return 0
