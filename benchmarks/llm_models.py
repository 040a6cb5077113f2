"""The model variants bench_llm.py compares: torchqkit configs and, when installed in the running Python,
peer libraries (torchao, optimum-quanto, hqq). Every variant quantizes the same Linears of a causal LM in
place and keeps the output layer `lm_head` (tied to the input embedding) in float.

Peers are optional: they are imported only here, only when a peer variant runs, and are never torchqkit
dependencies. A peer that refuses a format on this machine becomes a row saying why, not a crash.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import torchqkit as qk

KEEP_FLOAT = "lm_head"


@dataclass
class Quantized:
    """What a variant did: Linears quantized out of those it was offered, and anything worth a note."""
    quantized: int
    offered: int
    note: str = ""


@dataclass(frozen=True)
class Variant:
    name: str
    library: str                                   # "torchqkit" or the peer's distribution name
    apply: Callable[[nn.Module], Quantized] | None  # None: the float model itself


class Refused(Exception):
    """A library can't produce this variant here (missing option, refusal on CPU); the message says why."""


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor; tensor subclasses (torchqkit, torchao, quanto) are summed over the inner
    tensors their __tensor_flatten__ names, recursively (quanto packs its codes in a nested subclass)."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def linear_weight_bytes(model: nn.Module) -> int:
    """Weight bytes (codes + scales + zero points) of every Linear-like module except lm_head."""
    total = 0
    for fqn, module in model.named_modules():
        if fqn == KEEP_FLOAT:
            continue
        if _is_hqq_linear(module):
            total += tensor_bytes(module.W_q)
            total += sum(tensor_bytes(v) for v in module.meta.values() if isinstance(v, torch.Tensor))
        elif isinstance(module, nn.Linear):
            total += tensor_bytes(module.weight)
    return total


def offered_linears(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn != KEEP_FLOAT]


# --------------------------------------------------------------------------------------------------------
# torchqkit
# --------------------------------------------------------------------------------------------------------

def _torchqkit(make_config: Callable[[], qk.QuantConfig]) -> Callable[[nn.Module], Quantized]:
    def apply(model: nn.Module) -> Quantized:
        try:
            config = make_config()
        except TypeError as err:      # an option this torchqkit does not have (yet)
            raise Refused(f"option missing in this torchqkit: {err}") from None
        report = qk.quantize_(model, qk.ModuleConfigs({KEEP_FLOAT: None, "_default": config}))
        offered = [e for e in report.entries if e.fqn != KEEP_FLOAT]
        reasons = Counter(e.reason for e in offered if e.status != "quantized")
        note = "; ".join(f"{n} skipped: {reason}" for reason, n in reasons.most_common(2))
        return Quantized(sum(e.status == "quantized" for e in offered), len(offered), note)
    return apply


def torchqkit_variants() -> list[Variant]:
    rows = []
    for g in (32, 64, 128):
        rows.append(Variant(f"int4-rtn-g{g}", "torchqkit",
                            _torchqkit(lambda g=g: qk.Int4WeightOnlyConfig(group_size=g))))
    for g in (32, 64, 128):
        rows.append(Variant(f"int4-hqq-g{g}", "torchqkit",
                            _torchqkit(lambda g=g: qk.Int4WeightOnlyConfig(group_size=g, algorithm="hqq"))))
    rows.append(Variant("int8-wo", "torchqkit", _torchqkit(qk.Int8WeightOnlyConfig)))
    return rows


# --------------------------------------------------------------------------------------------------------
# peers
# --------------------------------------------------------------------------------------------------------

def _torchao(make_config: Callable) -> Callable[[nn.Module], Quantized]:
    def apply(model: nn.Module) -> Quantized:
        import torchao.quantization as aoq
        try:
            config = make_config(aoq)
            aoq.quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != KEEP_FLOAT)
        except Exception as err:     # torchao raises what its backends raise (ImportError, RuntimeError, ...)
            raise Refused(f"torchao refuses on this CPU: {type(err).__name__}: {err}") from None
        done = [fqn for fqn in offered_linears(model) if type(model.get_submodule(fqn).weight) is not nn.Parameter]
        return Quantized(len(done), len(offered_linears(model)))
    return apply


def _quanto(weights: str) -> Callable[[nn.Module], Quantized]:
    def apply(model: nn.Module) -> Quantized:
        from optimum import quanto
        offered = len(offered_linears(model))
        quanto.quantize(model, weights=getattr(quanto, weights), exclude=[KEEP_FLOAT])
        quanto.freeze(model)
        layers = [m for fqn, m in model.named_modules() if isinstance(m, quanto.QModuleMixin) and fqn != KEEP_FLOAT]
        groups = Counter(m.weight.numel() // m.weight._scale.numel() for m in layers)
        note = "elements per scale: " + ", ".join(f"{g} ({n} layers)" for g, n in groups.most_common())
        return Quantized(len(layers), offered, note)
    return apply


def _hqq(group_size: int) -> Callable[[nn.Module], Quantized]:
    def apply(model: nn.Module) -> Quantized:
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
        config = BaseQuantizeConfig(nbits=4, group_size=group_size)
        names = offered_linears(model)
        for fqn in names:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child)
            setattr(parent, child, HQQLinear(linear, quant_config=config, compute_dtype=torch.float32,
                                             device=str(linear.weight.device)))
        # hqq groups the row-major weight flattened (axis=1): with K % group_size != 0 a group spans two rows.
        spans = sum(model.get_submodule(fqn).in_features % group_size != 0 for fqn in names)
        return Quantized(len(names), len(names), f"{spans} layers with groups spanning rows" if spans else "")
    return apply


def _is_hqq_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "HQQLinear" and hasattr(module, "W_q")


PEERS = {  # distribution name -> module to look for
    "torchao": "torchao",
    "optimum-quanto": "optimum.quanto",
    "hqq": "hqq",
}


def installed_peers() -> dict[str, str | None]:
    """Peer distribution -> its version, or None when it is not installed in the running Python."""
    found = {}
    for dist, module in PEERS.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:         # the parent package (optimum) is missing
            present = False
        found[dist] = importlib.metadata.version(dist) if present else None
    return found


def peer_variants() -> list[Variant]:
    """Rows for the peers installed in the running Python."""
    available = installed_peers()
    rows = []
    if available["torchao"]:
        for g in (32, 64, 128):
            rows.append(Variant(f"torchao-int4-g{g}", "torchao",
                                _torchao(lambda aoq, g=g: aoq.Int4WeightOnlyConfig(group_size=g))))
        rows.append(Variant("torchao-int8-wo", "torchao", _torchao(lambda aoq: aoq.Int8WeightOnlyConfig())))
    if available["optimum-quanto"]:
        rows.append(Variant("quanto-qint4", "optimum-quanto", _quanto("qint4")))
        rows.append(Variant("quanto-qint8", "optimum-quanto", _quanto("qint8")))
    if available["hqq"]:
        for g in (32, 64, 128):
            rows.append(Variant(f"hqq-4bit-g{g}", "hqq", _hqq(g)))
    return rows


def all_variants(peers: bool) -> list[Variant]:
    return [Variant("float32", "torch", None), *torchqkit_variants(), *(peer_variants() if peers else [])]
