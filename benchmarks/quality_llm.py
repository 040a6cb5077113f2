"""The quality group's LLM rows: perplexity of SmolLM2-135M per config on the text torchqkit ships, Linear weight
bytes and greedy decode tokens/s (HF generate), torchqkit next to the peers installed in this Python.

The model is SmolLM2's GGUF dequantized to float32. Its Linears were stored as Q4_1 (asymmetric 4-bit, groups of 32
along K), so they sit exactly on a g32 asymmetric grid and int4 g32 round-to-nearest would rebuild them with no loss;
by default the hidden, MLP-intermediate and value-head channels are therefore permuted first
(torchqkit.eval.permute_llama_channels_: each K-group then mixes several Q4_1 groups); --no-permute measures the raw
model. Every row quantizes the same Linears; lm_head, tied to the input embedding, stays float32 everywhere."""
from __future__ import annotations

import copy
import sys
import traceback

import torch

import torchqkit as qk
from torchqkit.eval import decode_tokens_per_second, eval_text, permute_llama_channels_, perplexity

from . import quality_peers as peers
from .common import llm
from .common.configs import build

PROMPT_TOKENS = 16


def _torchqkit_apply(name: str):
    def apply(model):
        config = build(name)
        if config is None:
            return peers.Quantized(0, len(peers.offered_linears(model)))
        if isinstance(config, qk.ModuleConfigs):
            raise ValueError(f"{name}: a body + output-layer preset; every row of this group keeps lm_head float "
                             f"(compare output layers with python -m torchqkit eval --config {name})")
        report = qk.quantize_(model, qk.ModuleConfigs({peers.KEEP_FLOAT: None, "_default": config}))
        offered = [e for e in report.entries if e.fqn != peers.KEEP_FLOAT]
        return peers.Quantized(sum(e.status == "quantized" for e in offered), len(offered))
    return apply


def linear_weight_bytes(model) -> int:
    """Weight bytes (codes + scales + zero points) of every Linear-like module except lm_head."""
    total = 0
    for fqn, module in model.named_modules():
        if fqn == peers.KEEP_FLOAT:
            continue
        if peers.is_hqq_linear(module):
            total += llm.tensor_bytes(module.W_q)
            total += sum(llm.tensor_bytes(v) for v in module.meta.values() if isinstance(v, torch.Tensor))
        elif isinstance(module, torch.nn.Linear):
            total += llm.tensor_bytes(module.weight)
    return total


def run(args, rec) -> None:
    model_llm = llm.load(args.quick)
    model = model_llm.model
    ids = model_llm.tokenize(eval_text())[:args.tokens]
    permuted = not args.no_permute
    if permuted:
        with torch.no_grad():
            permute_llama_channels_(model, seed=0)
    shape = {"model": model_llm.name, "tokens": ids.numel(), "window": args.window, "permuted": permuted}
    rows = [("torchqkit", name, _torchqkit_apply(name)) for name in args.configs]
    if not args.no_peers:
        rows += [(r.library, r.config, r.apply) for r in peers.rows()]
    float_ppl = None
    for library, config, apply in rows:
        print(f"[quality] {config} ({library})", file=sys.stderr, flush=True)
        q = copy.deepcopy(model)
        try:
            done = apply(q)
            ppl = perplexity(q, ids, args.window, progress=False)
            tok_s = decode_tokens_per_second(q, ids[:PROMPT_TOKENS], new_tokens=args.new_tokens,
                                             repeats=args.repeats, decode="generate")
        except peers.Refused as err:
            rec.add(library, config, shape, "perplexity", None, "", note=str(err))
            continue
        except Exception as err:  # one broken row must not lose the others' measurements
            traceback.print_exc()
            rec.add(library, config, shape, "perplexity", None, "", note=f"FAILED: {type(err).__name__}: {err}")
            continue
        extra = {"quantized": f"{done.quantized}/{done.offered}", **({"note": done.note} if done.note else {})}
        float_ppl = ppl if config == "float32" else float_ppl
        rec.add(library, config, shape, "perplexity", ppl, "", **extra)
        if float_ppl is not None and config != "float32":
            rec.add(library, config, shape, "perplexity vs float32", 100 * (ppl - float_ppl) / float_ppl, "%")
        rec.add(library, config, shape, "Linear weights", linear_weight_bytes(q) / 1e6, "MB")
        rec.add(library, config, shape, "decode (generate)", tok_s, "tok/s")
        del q
