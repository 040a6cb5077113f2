"""The quality benchmarks' shared pieces: MiniLM embedding losses per config, and the markdown table of each config's
metric, its loss (increase over float) and bits per weight, then each target as a ratio of two configs' losses against
its bound."""
from __future__ import annotations

import sys

import torch


def embedding_losses(model, configs, sentences, quantize, tag: str) -> dict:
    """{config: (1 - cos, 1 - cos, bits per weight)}: the mean cosine distance of each sentence's embedding under the
    quantized model (``quantize(model, name) -> (copy, bits)``) to the float model's, for a sentence-transformers
    ``model``."""
    def embed(m):
        return m.encode(sentences, batch_size=32, convert_to_tensor=True, normalize_embeddings=True).float()
    reference = embed(model)
    out = {}
    for name in configs:
        print(f"[{tag}] MiniLM {name}", file=sys.stderr, flush=True)
        q, bits = quantize(model, name)
        loss = float(1 - torch.nn.functional.cosine_similarity(embed(q), reference, dim=-1).mean())
        out[name] = (loss, loss, bits)
        del q
    return out


def loss_table(title: str, metric: str, rows: dict, targets) -> list[str]:
    """Markdown lines for ``rows`` ({config: (metric value, loss, bits per weight or None)}) and ``targets``
    ((config, reference config, bound) or (..., bound, True) for "strictly below": the ratio of their losses must be
    <= bound, or < bound); a target whose configs didn't run, or whose reference lost nothing, is left out."""
    lines = [f"### {title}", "", f"| config | {metric} | loss | bits / weight |", "|---|---:|---:|---:|"]
    for name, (value, loss, bits) in rows.items():
        lines.append(f"| {name} | {value:.5g} | {loss:.4g} | {'-' if bits is None else f'{bits:.2f}'} |")
    lines += ["", "| target | loss ratio | bound | met |", "|---|---:|---:|---|"]
    for name, ref, bound, *strict in targets:
        if name in rows and ref in rows and rows[ref][1]:
            ratio = rows[name][1] / rows[ref][1]
            below = bool(strict and strict[0])
            met = ratio < bound if below else ratio <= bound
            lines.append(f"| {name} / {ref} | {ratio:.3f} | {'<' if below else '<='} {bound:g} | "
                         f"{'yes' if met else 'NO'} |")
    return lines + [""]
