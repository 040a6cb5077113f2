"""Op tables: each owner (a Layout class, or the generic AffineQuantizedTensor ops) keeps its own
``{op: fn}`` dict. Lookup is an exact dict hit, never "the first predicate that matches".

This is also the one place that formats the error for an op nobody implements.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["OpTable", "UnsupportedOpError", "fill_defaults"]


class UnsupportedOpError(NotImplementedError):
    """An op was called on an ``AffineQuantizedTensor`` whose layout has no implementation of it.

    Raised by the quantized tensor's dispatch (``__torch_dispatch__`` / ``__torch_function__``) when an op is in
    neither the layout's op table nor the generic one: torchqkit never silently dequantizes. The message names the
    layout, the op and the ops it supports; call ``.dequantize()`` on the weight first to run anything else. A
    ``NotImplementedError``.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout())
        try:
            torch.sin(w)
        except qk.UnsupportedOpError as e:
            y = torch.sin(w.dequantize())     # explicit: materialize the float weight
        ```
    """
    def __init__(self, op, layout, supported):
        names = sorted(_op_name(o) for o in supported)
        super().__init__(
            f"AffineQuantizedTensor with layout {layout!r} has no implementation of {_op_name(op)}. "
            f"Ops it supports: {', '.join(names)}. To run anything else, call .dequantize() on the "
            f"weight first (this materializes the float weight; torchqkit never does it for you).")


def _op_name(op) -> str:
    if isinstance(op, str):  # an op of a library torchqkit doesn't import, keyed by its qualified name
        return op
    if hasattr(op, "_schema"):  # an aten OpOverload: "aten::mm"
        return str(op._schema.name) + ("" if op._overloadname == "default" else f".{op._overloadname}")
    return f"{op.__module__}.{op.__qualname__}"


class OpTable:
    def __init__(self, owner: str):
        self.owner = owner
        self.fns: dict[object, Callable] = {}

    def implements(self, *ops):
        def deco(fn):
            for op in ops:
                if op in self.fns:
                    raise RuntimeError(f"{self.owner}: {_op_name(op)} registered twice")
                self.fns[op] = fn
            return fn
        return deco

    def get(self, op):
        return self.fns.get(op)

    def __contains__(self, op) -> bool:
        return op in self.fns


def fill_defaults(args, n: int, defaults_tail):
    """Pad positional ``args`` to ``n`` entries with the last entries of ``defaults_tail``."""
    args = list(args)
    if n - len(defaults_tail) > len(args):
        raise RuntimeError("not enough defaults to fill arguments")
    for i in range(len(args), n):
        args.append(defaults_tail[i - n + len(defaults_tail)])
    return args
