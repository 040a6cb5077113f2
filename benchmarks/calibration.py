"""Calibrated quantization (GPTQ, AWQ, SmoothQuant, static int8) against round-to-nearest and HQQ: SmolLM2-135M
perplexity and all-MiniLM-L6-v2 embedding cosine; GPTQ's memory and time; the activation outliers static int8 meets.

    python -m benchmarks calibration                          # the quality rows (SmolLM2 + MiniLM)
    python -m benchmarks calibration --memory                 # GPTQ peak RSS / wall time: SmolLM2 and a ~1B LLaMA
    python -m benchmarks calibration --configs int4-wo-g128,int4-wo-g128+gptq --tokens 1024
    python -m benchmarks calibration --outliers               # why static int8 needs smoothing: input ranges
    python -m benchmarks calibration --quick [--minilm]       # the tiny LLM (and MiniLM on 16 sentences)

A config `<preset>+<change>` is compared with its preset (the "vs preset" metrics: its perplexity increase over
float32 divided by the preset's). SmolLM2: the GGUF dequantized to float32, channels permuted as in the quality group
(its Linears sit on a Q4_1 grid otherwise); every Linear but the tied lm_head is quantized. Perplexity on tokens
[0, --tokens) of the text torchqkit ships; calibration on --calib-batches windows of 256 tokens from token 8192 on
(text the perplexity never reads). MiniLM: all 37 Linears; calibrated on the last 64 packaged demo sentences, cosine
of each other sentence's embedding to the float32 one. One torch thread by default: on a busy 2-core host two OpenMP
threads waiting on each other made the Cholesky factorizations 18x slower.
"""
from __future__ import annotations

import copy
import gc
import sys
import time

import torch

import torchqkit as qk
from torchqkit.eval import eval_text, permute_llama_channels_, perplexity

from .common import cli, llm
from .common.configs import build

GROUP = "calibration"
DEFAULT_CONFIGS = ["float32", "int4-wo-g128", "int4-wo-g128+hqq", "int4-wo-g128+gptq", "int4-wo-g128+awq",
                   "int8-dyn-int8", "int8-dyn-int8+smoothquant", "int8-dyn-int8+static", "int8-dyn-int8+static+mse",
                   "int8-dyn-int8+static+no-smoothing"]
QUICK_CONFIGS = ["float32", "int4-wo-g32", "int4-wo-g32+gptq", "int8-dyn-int8", "int8-dyn-int8+static"]
# --quick's MiniLM rows: GPTQ over MiniLM's 37 Linears takes ~12 s even on 16 sentences; the LLM rows cover it.
QUICK_MINILM = ["float32", "int8-dyn-int8", "int8-dyn-int8+static"]
CALIB_START, CALIB_WINDOW = 8192, 256


def _quantize(model, name, batches, keep_lm_head: bool):
    q = copy.deepcopy(model)
    config = build(name)
    if config is None:
        return q, 0.0, "-"
    configs = qk.ModuleConfigs({"lm_head": None, "_default": config}) if keep_lm_head else config
    start = time.perf_counter()
    report = qk.quantize_(q, configs, calibration_data=batches)
    return q, time.perf_counter() - start, f"{len(report.quantized)}/{len(report.entries) - keep_lm_head}"


def smollm2(args):
    model_llm = llm.load(args.quick)
    ids = model_llm.tokenize(eval_text())
    with torch.no_grad():
        permute_llama_channels_(model_llm.model, seed=0)
    window = 32 if args.quick else CALIB_WINDOW
    batches = [ids[CALIB_START + i * window: CALIB_START + (i + 1) * window].unsqueeze(0)
               for i in range(args.calib_batches)]
    return model_llm, ids[:args.tokens], batches


def _relative(rec, case, name, shape, metric, value, float_value, preset_value):
    """The preset's comparison: (value - float) / (preset's - float), for a `<preset>+<change>` row."""
    if "+" in name and preset_value is not None and float_value is not None and preset_value != float_value:
        rec.add(case, name, shape, f"{metric} vs preset", (value - float_value) / (preset_value - float_value), "x")


def run_llm(args, rec, model_llm, ids, batches):
    shape = {"model": model_llm.name, "tokens": ids.numel(), "calibration": f"{len(batches)} x {batches[0].shape[1]}"}
    ppl = {}
    for name in args.configs:
        print(f"[calibration] {model_llm.name} {name}", file=sys.stderr, flush=True)
        q, seconds, done = _quantize(model_llm.model, name, batches, keep_lm_head=True)
        ppl[name] = perplexity(q, ids, 64 if args.quick else 512, progress=False)
        rec.add("LLM perplexity", name, shape, "perplexity", ppl[name], "", quantized=done)
        rec.add("LLM perplexity", name, shape, "calibrate", seconds, "s")
        _relative(rec, "LLM perplexity", name, shape, "perplexity increase", ppl[name], ppl.get("float32"),
                  ppl.get(name.split("+")[0]))
        del q


def run_minilm(args, rec):
    from torchqkit.demo import load_model, load_sentences
    model = load_model()
    sentences = load_sentences()
    calib, evaluate = (sentences[-16:], sentences[:16]) if args.quick else (sentences[-64:], sentences[:-64])
    batches = [(dict(model.tokenizer(calib[i:i + 16], padding=True, truncation=True, return_tensors="pt")),)
               for i in range(0, len(calib), 16)]

    def embed(m):
        return m.encode(evaluate, batch_size=32, convert_to_tensor=True, normalize_embeddings=True).float()
    reference = embed(model)
    shape = {"model": "all-MiniLM-L6-v2", "sentences": len(evaluate), "calibration sentences": len(calib)}
    loss = {}
    for name in [c for c in args.configs if c in QUICK_MINILM] if args.quick else args.configs:
        print(f"[calibration] MiniLM {name}", file=sys.stderr, flush=True)
        q, seconds, done = _quantize(model, name, batches, keep_lm_head=False)
        cos = torch.nn.functional.cosine_similarity(embed(q), reference, dim=-1)
        loss[name] = float(1 - cos.mean())
        rec.add("MiniLM cosine", name, shape, "1 - cos (mean)", loss[name], "", quantized=done)
        rec.add("MiniLM cosine", name, shape, "1 - cos (worst)", float(1 - cos.min()), "")
        rec.add("MiniLM cosine", name, shape, "calibrate", seconds, "s")
        _relative(rec, "MiniLM cosine", name, shape, "1 - cos", loss[name], 0.0, loss.get(name.split("+")[0]))
        del q


def run_outliers(rec, model_llm, batches, top: int = 12):
    """The Linear inputs one static per-tensor scale serves worst: max |x| over the calibration text against the
    median over tokens of each token's max |x| (what a per-token dynamic scale covers)."""
    model = model_llm.model
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.setdefault(n, []).append(
        a[0].detach().abs().reshape(-1, a[0].shape[-1]).amax(dim=1)))
        for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    stats = sorted(((float(t.max() / t.median()), n, float(t.max()), float(t.median()))
                    for n, t in ((n, torch.cat(v)) for n, v in seen.items())), reverse=True)
    shape = {"model": model_llm.name, "calibration": f"{len(batches)} x {batches[0].shape[1]}"}
    for ratio, name, amax, med in stats[:top]:
        rec.add(f"input of {name}", "float32", shape, "max |x| / median token max", ratio, "x", max_abs=amax,
                median_token_max=med, int8_step=amax / 127)


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--tokens", type=int, default=2048, help="LLM tokens scored (default 2048)")
    p.add_argument("--calib-batches", type=int, default=16, help="calibration windows of 256 tokens (default 16)")
    p.add_argument("--no-minilm", action="store_true", help="LLM rows only")
    p.add_argument("--minilm", action="store_true", help="--quick: the MiniLM rows too (its load alone takes ~10 s)")
    p.add_argument("--memory", action="store_true", help="GPTQ peak RSS and wall time instead of the quality rows")
    p.add_argument("--outliers", action="store_true", help="per Linear input: max |x| against a typical token's max")
    p.set_defaults(threads=1)
    args, rec = cli.start(GROUP, p, argv)
    cli.quick(args, argv, tokens=128, calib_batches=2, configs=QUICK_CONFIGS)
    model_llm, ids, batches = smollm2(args)
    if args.memory:
        from . import calibration_memory
        calibration_memory.run(args, rec, model_llm, batches)
    elif args.outliers:
        run_outliers(rec, model_llm, batches)
    else:
        run_llm(args, rec, model_llm, ids, batches)
        del model_llm
        gc.collect()
        if not args.no_minilm and not (args.quick and "--minilm" not in (argv or [])):
            run_minilm(args, rec)
    rec.print_table()
    return 0
