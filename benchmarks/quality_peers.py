"""Peer libraries' versions of torchqkit's formats for the quality group (torchao, optimum-quanto, hqq), when installed
in the running Python: imported only here and only when a peer row runs, never torchqkit dependencies. Each peer row
is named by the preset whose format it reproduces (its record's config) and by the library (its case). A peer that
refuses a format on this machine becomes a note, not a crash."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

KEEP_FLOAT = "lm_head"


@dataclass
class Quantized:
    """What a row did: Linears quantized out of those offered, and anything worth a note."""
    quantized: int
    offered: int
    note: str = ""


@dataclass(frozen=True)
class PeerRow:
    library: str    # the peer's distribution name
    config: str     # the torchqkit preset of the same format
    apply: Callable[[nn.Module], Quantized]


class Refused(Exception):
    """A library can't produce this row here (missing option, refusal on CPU); the message says why."""


def offered_linears(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn != KEEP_FLOAT]


def _torchao(make_config: Callable) -> Callable[[nn.Module], Quantized]:
    def apply(model):
        import torchao.quantization as aoq
        try:
            aoq.quantize_(model, make_config(aoq),
                          filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != KEEP_FLOAT)
        except Exception as err:  # torchao raises what its backends raise (ImportError, RuntimeError, ...)
            raise Refused(f"torchao refuses on this CPU: {type(err).__name__}: {err}") from None
        done = [f for f in offered_linears(model) if type(model.get_submodule(f).weight) is not nn.Parameter]
        return Quantized(len(done), len(offered_linears(model)))
    return apply


def _quanto(weights: str) -> Callable[[nn.Module], Quantized]:
    def apply(model):
        from optimum import quanto
        offered = len(offered_linears(model))
        quanto.quantize(model, weights=getattr(quanto, weights), exclude=[KEEP_FLOAT])
        quanto.freeze(model)
        layers = [m for f, m in model.named_modules() if isinstance(m, quanto.QModuleMixin) and f != KEEP_FLOAT]
        groups = Counter(m.weight.numel() // m.weight._scale.numel() for m in layers)
        return Quantized(len(layers), offered, "elements per scale: " + ", ".join(f"{g} ({n} layers)"
                                                                                 for g, n in groups.most_common()))
    return apply


def _hqq(group_size: int) -> Callable[[nn.Module], Quantized]:
    def apply(model):
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
        config = BaseQuantizeConfig(nbits=4, group_size=group_size)
        names = offered_linears(model)
        for fqn in names:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child)
            setattr(parent, child, HQQLinear(linear, quant_config=config, compute_dtype=torch.float32,
                                             device=str(linear.weight.device)))
        # hqq groups the row-major weight flattened: with K % group_size != 0 a group spans two rows.
        spans = sum(model.get_submodule(f).in_features % group_size != 0 for f in names)
        return Quantized(len(names), len(names), f"{spans} layers with groups spanning rows" if spans else "")
    return apply


def is_hqq_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "HQQLinear" and hasattr(module, "W_q")


PEERS = {"torchao": "torchao", "optimum-quanto": "optimum.quanto", "hqq": "hqq"}  # distribution -> module


def installed() -> dict[str, str | None]:
    """Peer distribution -> its version, or None when it is not installed in the running Python."""
    found = {}
    for dist, module in PEERS.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package (optimum) is missing
            present = False
        found[dist] = importlib.metadata.version(dist) if present else None
    return found


def rows() -> list[PeerRow]:
    available = installed()
    out = []
    if available["torchao"]:
        out += [PeerRow("torchao", f"int4-wo-g{g}", _torchao(lambda aoq, g=g: aoq.Int4WeightOnlyConfig(group_size=g)))
                for g in (32, 64, 128)]
        out.append(PeerRow("torchao", "int8-wo", _torchao(lambda aoq: aoq.Int8WeightOnlyConfig())))
    if available["optimum-quanto"]:
        # quanto's qint4: asymmetric 4-bit in groups of 128 (its note records the elements per scale it used)
        out += [PeerRow("optimum-quanto", "int4-wo-g128", _quanto("qint4")),
                PeerRow("optimum-quanto", "int8-wo", _quanto("qint8"))]
    if available["hqq"]:
        out += [PeerRow("hqq", f"int4-wo-g{g}+hqq", _hqq(g)) for g in (32, 64, 128)]
    return out
