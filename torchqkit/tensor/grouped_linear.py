"""torchqkit::grouped_linear_quantized: a linear per group of sorted tokens with each group's own quantized expert.

Note [Grouped quantized linear]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)`` (transformers' "grouped_mm" experts) and the batched
``torch.bmm`` on gathered experts (its "batched_mm") both mean: rows ``[offs[g - 1], offs[g])`` of x go through
``F.linear`` with expert g. For a quantized stack this op does exactly that, one expert at a time, and groups
without tokens are skipped: a decode step reads only the routed experts' bytes. Two ways, the same numbers:
- where the case's route has a grouped op with a C++ CPU kernel (``Route.grouped``: every weight-only format, int8
  or int4 dynamic activations on the integer kernels, and the activation configs that run a weight-only kernel on
  the fake-quantized input) and the activations are on the CPU, that one op call for the
  whole stack: the 2-d op's kernels run from C++ on each expert with rows, on a view of it (Note [Grouped linear in
  C++], csrc/cpu/grouped_rows.h). The route is decided once per format and activation dtype. Eager,
  ``grouped_linear`` calls the grouped op itself; a compiled graph calls this module's op, which calls it inside.
- otherwise this module's op ``torchqkit::grouped_linear_quantized`` runs a Python loop over the 2-d expert views
  (Note [Expert weights]) where every expert runs its layout's own linear (C++ CPU, CUDA, Triton, or the reference,
  as ``kernels.status()`` says for the layout), at the cost of a tensor subclass and a dispatch per routed expert
  (tens of microseconds, more than a small expert's kernel).

It is a custom op, not Python inside ``__torch_dispatch__``, because the group boundaries are data: under
``torch.compile(fullgraph=True)`` the op stays opaque (its fake only gives the output shape) and runs eagerly
inside the compiled graph, as transformers' own float fallback does. A custom op takes tensors and plain values,
so the stack's format travels as a string (``expert_spec``: JSON, in base64 for inductor's C++ wrapper) and each
call rebuilds the 2-d views from the stack's inner tensors. Rows past ``offs[-1]`` (expert-parallel sentinels) are
zeros.
"""
from __future__ import annotations

import base64
import functools
import json
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..core import granularity as _granularity
from ..core.qdtype import qdtype_from_name
from ..kernels.status import register_status_rows
from ..layouts.base import Layout
from ..layouts.routes import GroupedRoute, route_for
from .activation import ActivationQuantSpec, KernelPreference

__all__ = ["grouped_linear", "expert_spec"]

_GRANULARITIES = {c.__name__: c for c in (_granularity.PerTensor, _granularity.PerRow, _granularity.PerToken,
                                          _granularity.PerGroup, _granularity.PerAxis, _granularity.PerBlock)}


def expert_spec(w) -> str:
    """The format of one expert of the stack ``w`` as a string (the op's ``spec`` argument: base64 of JSON).

    Kept on the stack after the first call: the fields it encodes are fixed when a tensor is built, and every
    decode step of every MoE layer asks for it (the JSON encoding costs about as much as the per-expert call of a
    small expert's kernel)."""
    spec = w.__dict__.get("_expert_spec")
    if spec is None:
        spec = w.__dict__["_expert_spec"] = _encode_spec(w)
    return spec


def _encode_spec(w) -> str:
    act = w.act_quant
    return _to_spec({
        "qdtype": w.qdtype.name, "block_size": list(w.block_size[1:]), "shape": list(w.logical_shape[1:]),
        "dtype": str(w.orig_dtype).removeprefix("torch."), "layout": w.qlayout.to_dict(),
        "zero_point_domain": w.zero_point_domain.value, "kernel_preference": w.kernel_preference.value,
        "act_quant": None if act is None else {
            "qdtype": act.qdtype.name, "mapping": act.mapping.value, "static_scale": act.static_scale,
            "granularity": {"type": type(act.granularity).__name__, **vars(act.granularity)}},
    })


def _to_spec(fields: dict) -> str:
    """JSON in URL-safe base64: no quote or backslash, because inductor's C++ wrapper (the compiled decode step's)
    writes a str argument into a C++ string literal as it is, and the quotes of plain JSON end that literal."""
    return base64.urlsafe_b64encode(json.dumps(fields, sort_keys=True).encode()).decode()


@functools.lru_cache(maxsize=256)
def _attrs(spec: str) -> dict:
    d = json.loads(base64.urlsafe_b64decode(spec))
    act = d["act_quant"]
    if act is not None:
        g = dict(act["granularity"])
        g = _GRANULARITIES[g.pop("type")](**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()})
        act = ActivationQuantSpec(qdtype_from_name(act["qdtype"]), g, act["mapping"], act["static_scale"])
    return {"qdtype": qdtype_from_name(d["qdtype"]), "block_size": tuple(d["block_size"]),
            "logical_shape": tuple(d["shape"]), "orig_dtype": getattr(torch, d["dtype"]),
            "qlayout": Layout.from_dict(d["layout"]), "zero_point_domain": d["zero_point_domain"],
            "act_quant": act, "kernel_preference": KernelPreference(d["kernel_preference"])}


@torch.library.custom_op("torchqkit::grouped_linear_quantized", mutates_args=())
def _grouped_linear_op(x: torch.Tensor, offs: torch.Tensor, tensors: list[torch.Tensor | None],
                       spec: str) -> torch.Tensor:
    """out[rows of group g] = F.linear(x[rows of group g], expert g); see Note [Grouped quantized linear].
    ``tensors``: the stack's inner tensors in the layout's ``tensor_names`` order (None where the stack has none)."""
    from .affine_quantized_tensor import AffineQuantizedTensor  # imports this module's package
    attrs = _attrs(spec)
    names = attrs["qlayout"].tensor_names

    def expert(g: int) -> AffineQuantizedTensor:
        return AffineQuantizedTensor({n: None if t is None else t[g] for n, t in zip(names, tensors)}, **attrs)

    grouped = _grouped_route(spec, x, lambda: expert(0)) if offs.shape[0] else None  # offs: one end per expert
    if grouped is not None:
        return _run_grouped(grouped, names, tensors, spec, x, offs)
    out = x.new_zeros(x.shape[0], attrs["logical_shape"][0])
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host sync for all groups
        if end > start:
            out[start:end] = expert(g).linear(x[start:end])  # torch function is off here: the quantized linear
        start = max(start, end)
    return out


_GROUPED_ROUTES: dict[tuple[str, torch.dtype], GroupedRoute | None] = {}


def _grouped_route(spec: str, x: torch.Tensor, first_expert) -> GroupedRoute | None:
    """The grouped op serving a whole stack at once (Note [Grouped quantized linear]): under KernelPreference.AUTO,
    for CPU activations, where the route the experts' linear takes (``first_expert()``: one expert of the stack, a
    2-d quantized weight, built only when the format is new) has a grouped op with a C++ CPU kernel; None means one
    2-d linear per expert. Decided once per (format, activation dtype)."""
    if x.device.type != "cpu":
        return None
    key = (spec, x.dtype)
    if key not in _GROUPED_ROUTES:
        route = None
        if _attrs(spec)["kernel_preference"] is KernelPreference.AUTO:
            route = route_for(first_expert(), x)
        grouped = None if route is None or route.aten is not None else route.grouped
        if grouped is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(grouped.op, "CPU"):
            grouped = None  # no C++ kernel built: the 2-d ops per expert (their own status says what serves them)
        _GROUPED_ROUTES[key] = grouped
    return _GROUPED_ROUTES[key]


def _run_grouped(grouped: GroupedRoute, names, tensors, spec: str, x: torch.Tensor, offs: torch.Tensor):
    """The stack (inner ``tensors`` in ``names`` order, format ``spec``) through its grouped op, in one call."""
    return grouped.call(grouped.dispatched_op, dict(zip(names, tensors)), _fields(spec), x, offs)


@functools.lru_cache(maxsize=256)
def _fields(spec: str) -> SimpleNamespace:
    """One expert's fields (block_size, logical_shape, act_quant, ...) without its tensors: what a grouped call
    reads of the format."""
    return SimpleNamespace(**_attrs(spec))


@_grouped_linear_op.register_fake
def _(x, offs, tensors, spec):
    return x.new_empty(x.shape[0], _attrs(spec)["logical_shape"][0])


def grouped_linear(x: torch.Tensor, w, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``[offs[g - 1], offs[g])`` of ``x`` (M, K) times expert g of the quantized stack ``w`` (G, N, K): an
    (M, N) output, zero past ``offs[-1]``. See Note [Grouped quantized linear]."""
    k = w.logical_shape[-1]
    if x.dim() != 2 or x.shape[-1] != k or not x.is_floating_point():
        raise RuntimeError(f"grouped matmul with a quantized expert stack {tuple(w.logical_shape)} needs a 2-d float "
                           f"input of {k} features, got a {x.dtype} tensor of shape {tuple(x.shape)}; weight: {w!r}")
    if offs.dim() != 1 or offs.shape[0] != w.logical_shape[0] or offs.is_floating_point():
        raise RuntimeError(f"grouped matmul offsets: a 1-d integer tensor of {w.logical_shape[0]} group ends (one per "
                           f"expert), got a {offs.dtype} tensor of shape {tuple(offs.shape)}")
    if w.input_scale is not None:
        raise NotImplementedError(f"grouped matmul with a per-input-channel input_scale on an expert stack; weight: "
                                  f"{w!r}")
    names, spec, x = w.qlayout.tensor_names, expert_spec(w), x.contiguous()
    tensors = [getattr(w, n) for n in names]
    grouped = None
    if not torch.compiler.is_compiling() and w.logical_shape[0] > 0:  # a stack of no experts: nothing to run
        from .experts import expert_view  # imports the tensor subclass, which imports this module
        grouped = _grouped_route(spec, x, lambda: expert_view(w, 0))
    if grouped is not None:  # eager: the grouped op itself, without the Python op below around it
        return _run_grouped(grouped, names, tensors, spec, x, offs)
    # Compiled: the op below, which calls the grouped op inside (a graph calling the grouped op directly crashed in
    # inductor's C++ wrapper, which the lean decode loop uses on CPU: a tiny Qwen3-MoE with float16-scale int4
    # experts, freed twice before the op ran).
    return _grouped_linear_op(x, offs, tensors, spec)


register_status_rows(lambda: [{
    "layout": "(experts)", "linear": "torch._grouped_mm / torch.bmm on a quantized expert stack (E, N, K)",
    "path": "the route's grouped op, torchqkit::grouped_linear_<format> (C++ CPU: every weight-only format, int8 / "
            "int4 dynamic activations on the integer kernels, activation configs on a weight-only kernel), else "
            "torchqkit::grouped_linear_quantized: per routed expert its layout's linear row above",
    "why": "one call per stack where a grouped C++ kernel exists, else one 2-d call per expert with tokens; empty "
           "groups skipped either way (Note [Grouped quantized linear])"}])
