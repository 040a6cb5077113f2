"""QuantizationReport: one entry per Linear (and per module a config named), quantized or not and why.

Byte counts are the change in memory: a weight shared by several modules (see Note [Shared weights] in
quantize.py) is counted once, by the module that owns it; the others are "shared" entries with 0 -> 0.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerReport", "QuantizationReport"]

STATUSES = ("quantized", "shared", "skipped", "kept")


@dataclass
class LayerReport:
    """One layer's entry in a ``QuantizationReport``: what happened to it and its weight bytes before and after.

    Byte counts are the change in memory: a weight shared by several modules is counted once, by the module that
    owns it; the others are ``"shared"`` entries with 0 -> 0 bytes.

    Args:
        fqn (str): the module's name in the model.
        status (str): ``"quantized"``; ``"shared"`` (holds another entry's weight); ``"skipped"`` (the config
            couldn't take it); ``"kept"`` (no config, a None config, or tied to an embedding).
        config (str): the config's description (``QuantConfig.describe()``), or ``"-"``.
        reason (str): why it was skipped, kept or shared; when quantized, ``""`` or a note (e.g. where AWQ folded
            its scales).
        bytes_before (int): weight bytes before quantization.
        bytes_after (int): weight bytes after (packed codes, scales and zero points).
        shared_with (str): for ``"shared"`` entries, the Parameter it holds, ``"<owner fqn>.weight"``; default ``""``.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_(model, qk.Int8WeightOnlyConfig())
        for entry in report.skipped:
            print(entry.fqn, entry.reason)
        e = report["layers.0.mlp.up_proj"]
        print(e.status, e.bytes_before, e.bytes_after)
        ```
    """
    fqn: str
    status: str            # "quantized"; "shared" (holds another entry's weight); "skipped" (config couldn't take
                           # it); "kept" (no config / None / tied to an embedding)
    config: str            # config description, or "-"
    reason: str            # why it was skipped, kept or shared; when quantized, "" or a note (e.g. where AWQ
                           # folded its scales)
    bytes_before: int
    bytes_after: int
    shared_with: str = ""  # "shared": the Parameter it holds, "<owner fqn>.weight"


class QuantizationReport:
    """What ``quantize_`` (or ``quantize_checkpoint``, ``from_gguf``) did to each layer: one ``LayerReport``
    per Linear, and per module a config named.

    ``entries`` lists them in module order (iterating the report yields them too); ``report[fqn]`` finds one
    (``KeyError`` if absent); ``by_status(s)`` and the ``quantized`` / ``skipped`` / ``shared`` properties filter
    them; ``bytes_before`` / ``bytes_after`` total the weight bytes (a shared weight once); ``print(report)`` shows
    a table and a summary line. ``notes``
    holds what the table alone would hide: a float weight left in the model that reads at least half as many
    bytes per token as the quantized Linears together (Note [Float reads per token] in api/float_reads.py).

    Args:
        entries (list[LayerReport]): the layers' entries.
        notes (list[str] | None): lines ``print(report)`` shows under the summary; default none.

    Example:
        ```python
        import torchqkit as qk
        report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128))
        print(report)                     # a table, then "N quantized, 0 skipped, ...; weights A -> B bytes"
        print(len(report.quantized), report.bytes_before / report.bytes_after)
        ```
    """
    def __init__(self, entries: list[LayerReport], notes: list[str] | None = None):
        self.entries = entries
        self.notes = list(notes or [])

    def by_status(self, status: str) -> list[LayerReport]:
        return [e for e in self.entries if e.status == status]

    @property
    def quantized(self) -> list[LayerReport]:
        return self.by_status("quantized")

    @property
    def skipped(self) -> list[LayerReport]:
        return self.by_status("skipped")

    @property
    def shared(self) -> list[LayerReport]:
        return self.by_status("shared")

    @property
    def bytes_before(self) -> int:
        """Weight bytes of every reported layer before quantization (a shared weight once)."""
        return sum(e.bytes_before for e in self.entries)

    @property
    def bytes_after(self) -> int:
        """Weight bytes of every reported layer after (packed codes + scales + zero points; a shared weight once)."""
        return sum(e.bytes_after for e in self.entries)

    def __getitem__(self, fqn: str) -> LayerReport:
        for e in self.entries:
            if e.fqn == fqn:
                return e
        raise KeyError(f"no layer {fqn!r} in the report")

    def __len__(self):
        return len(self.entries)

    def __iter__(self):
        """The entries in module order (``for e in report``), like iterating ``report.entries``."""
        return iter(self.entries)

    def __str__(self) -> str:
        rows = [("layer", "status", "config / reason", "bytes before", "after")]
        for e in self.entries:
            text = (e.config + (f"; {e.reason}" if e.reason else "")) if e.status == "quantized" else e.reason
            rows.append((e.fqn, e.status, text,
                         f"{e.bytes_before:,}", f"{e.bytes_after:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        ratio = self.bytes_before / self.bytes_after if self.bytes_after else float("nan")
        counts = ", ".join(f"{len(self.by_status(s))} {s}" for s in STATUSES if s != "shared" or self.shared)
        lines.append(f"{counts}; weights {self.bytes_before:,} -> {self.bytes_after:,} bytes ({ratio:.2f}x smaller)")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    __repr__ = __str__
