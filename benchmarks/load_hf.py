"""load group, transformers part: a causal LM through transformers' from_pretrained, five ways, each in a fresh
process (so one's memory is not another's): the float model; float then qk.quantize_; quantized while loading
(quantization_config=qk.TorchqkitConfig); a torchqkit checkpoint loaded by transformers; the same by
qk.from_pretrained. Per way: the peak RSS increase of the load (VmHWM reset first; file pages of memory-mapped reads
included), the sampled peak of anonymous memory (without those file pages: VmHWM counts a 538 MB file read through
mmap whatever the loader keeps), Linear weight bytes, load seconds, perplexity, and whether the logits equal
quantize_'s bit for bit. The float checkpoint is the group's LLM saved as float32 safetensors. --quick runs the five
ways in this process on the tiny model (its memory figures then mean nothing)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common.configs import build
from .common.machine import REPO
from .common.rss import SampledPeak, peak_rss, reset_peak_rss, rss, rss_anon

MODES = {"float": "transformers, float32",
         "quantize_": "transformers float32, then qk.quantize_",
         "on_load": "transformers + TorchqkitConfig (quantize on load)",
         "hf_ckpt": "transformers, torchqkit checkpoint",
         "qk_ckpt": "qk.from_pretrained, torchqkit checkpoint"}


def child(mode: str, work: Path, tokens: int, config_name: str) -> dict:
    """One way's figures (run as `python -m benchmarks load --child ...` in a fresh process)."""
    from transformers import AutoModelForCausalLM

    import torchqkit as qk
    from torchqkit.eval import perplexity

    from .quality_llm import linear_weight_bytes
    config = build(config_name)
    ids = torch.load(work / "ids.pt")
    # Warm-up: the first quantized Parameter imports torch's subclass machinery, a fixed cost of any process that
    # uses quantized weights, not of the load.
    torch.nn.Parameter(qk.quantize_weight(torch.randn(8, 32), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout()),
                       requires_grad=False)
    gc.collect()
    reset_peak_rss()
    before, start = rss(), time.perf_counter()
    with SampledPeak(rss_anon, every_s=0.001) as anon:
        if mode in ("float", "quantize_"):
            model = AutoModelForCausalLM.from_pretrained(work / "float", dtype=torch.float32)
            if mode == "quantize_":
                qk.quantize_(model, config)
        elif mode == "on_load":
            model = AutoModelForCausalLM.from_pretrained(work / "float", dtype=torch.float32,
                                                         quantization_config=qk.TorchqkitConfig(config))
        elif mode == "hf_ckpt":
            model = AutoModelForCausalLM.from_pretrained(work / "int4")
        else:
            model = qk.from_pretrained(work / "int4")
        seconds, peak = time.perf_counter() - start, peak_rss()
    model.eval()
    if mode == "quantize_":
        qk.save_pretrained(model, work / "int4", config=config)
    with torch.no_grad():
        torch.save(model(ids[:128].unsqueeze(0)).logits, work / f"logits_{mode}.pt")
    return {"delta": max(peak - before, 0), "anon": anon.peak - anon.start, "linear": linear_weight_bytes(model),
            "seconds": seconds, "ppl": perplexity(model, ids[:tokens], window=min(512, tokens), progress=False)}


def _in_fresh_process(mode, work, tokens, config_name) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "load", "--child", mode, str(work), str(tokens),
                           config_name], capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    if proc.returncode:
        raise RuntimeError(f"{mode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args, rec, model_llm, work: Path) -> None:
    model, config_name = model_llm.model, args.config
    if getattr(model, "hf_quantizer", None) is not None:  # transformers' GGUF load: save it as plain float32
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(work / "float")
    from torchqkit.eval import eval_text
    torch.save(model_llm.tokenize(eval_text())[:max(args.tokens, 128)], work / "ids.pt")
    largest = max(f.stat().st_size for f in (work / "float").glob("*.safetensors"))
    shape = {"model": model_llm.name, "float_checkpoint_mb": round(largest / 1e6), "tokens": args.tokens}
    measure = ((lambda m: child(m, work, args.tokens, config_name)) if args.quick else
               (lambda m: _in_fresh_process(m, work, args.tokens, config_name)))
    results = {mode: measure(mode) for mode in MODES}
    reference = torch.load(work / "logits_quantize_.pt")
    for mode, r in results.items():
        config = "float32" if mode == "float" else config_name
        same = None if mode == "float" else torch.equal(torch.load(work / f"logits_{mode}.pt"), reference)
        rec.add(MODES[mode], config, shape, "peak RSS increase", r["delta"] / 1e6, "MB", logits_equal_quantize_=same)
        rec.add(MODES[mode], config, shape, "peak anonymous memory increase", r["anon"] / 1e6, "MB")
        rec.add(MODES[mode], config, shape, "Linear weights", r["linear"] / 1e6, "MB")
        rec.add(MODES[mode], config, shape, "load", r["seconds"], "s")
        rec.add(MODES[mode], config, shape, "perplexity", r["ppl"], "")
