"""The quality benchmarks' markdown table: each config's metric, its loss (increase over float) and bits per weight,
then each target as a ratio of two configs' losses against its bound."""
from __future__ import annotations


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
