"""torchqkit::grouped_linear_quantized: a linear per group of sorted tokens with each group's own quantized expert.

Note [Grouped quantized linear]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)`` (transformers' "grouped_mm" experts) and the batched
``torch.bmm`` on gathered experts (its "batched_mm") both mean: rows ``[offs[g - 1], offs[g])`` of x go through
``F.linear`` with expert g. For a quantized stack this op does exactly that, one expert at a time, with the 2-d
expert view (Note [Expert weights]), so every expert runs its layout's own linear kernel (C++ CPU, CUDA,
Triton, or the reference, as ``kernels.status()`` says for the layout) and groups without tokens are skipped:
a decode step reads only the routed experts' bytes. There is no fused multi-expert kernel; the loop's cost is one
kernel launch per routed expert.

It is a custom op, not Python inside ``__torch_dispatch__``, because the group boundaries are data: under
``torch.compile(fullgraph=True)`` the op stays opaque (its fake only gives the output shape) and runs eagerly
inside the compiled graph, as transformers' own float fallback does. A custom op takes tensors and plain values,
so the stack's format travels as a JSON string (``expert_spec``) and each call rebuilds the 2-d views from the
stack's inner tensors. Rows past ``offs[-1]`` (expert-parallel sentinels) are zeros.
"""
from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F

from ..core import granularity as _granularity
from ..core.qdtype import qdtype_from_name
from ..kernels.status import register_status_rows
from ..layouts.base import Layout
from .activation import ActivationQuantSpec, KernelPreference

__all__ = ["grouped_linear", "expert_spec"]

_GRANULARITIES = {c.__name__: c for c in (_granularity.PerTensor, _granularity.PerRow, _granularity.PerToken,
                                          _granularity.PerGroup, _granularity.PerAxis, _granularity.PerBlock)}


def expert_spec(w) -> str:
    """The format of one expert of the stack ``w`` as a JSON string (the op's ``spec`` argument).

    Kept on the stack after the first call: the fields it encodes are fixed when a tensor is built, and every
    decode step of every MoE layer asks for it (the JSON encoding costs about as much as the per-expert call of a
    small expert's kernel)."""
    spec = w.__dict__.get("_expert_spec")
    if spec is None:
        spec = w.__dict__["_expert_spec"] = _encode_spec(w)
    return spec


def _encode_spec(w) -> str:
    act = w.act_quant
    return json.dumps({
        "qdtype": w.qdtype.name, "block_size": list(w.block_size[1:]), "shape": list(w.logical_shape[1:]),
        "dtype": str(w.orig_dtype).removeprefix("torch."), "layout": w.qlayout.to_dict(),
        "zero_point_domain": w.zero_point_domain.value, "kernel_preference": w.kernel_preference.value,
        "act_quant": None if act is None else {
            "qdtype": act.qdtype.name, "mapping": act.mapping.value, "static_scale": act.static_scale,
            "granularity": {"type": type(act.granularity).__name__, **vars(act.granularity)}},
    }, sort_keys=True)


@functools.lru_cache(maxsize=256)
def _attrs(spec: str) -> dict:
    d = json.loads(spec)
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
    out = x.new_zeros(x.shape[0], attrs["logical_shape"][0])
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host sync for all groups
        if end > start:
            views = {n: None if t is None else t[g] for n, t in zip(attrs["qlayout"].tensor_names, tensors)}
            w = AffineQuantizedTensor(views, **attrs)
            out[start:end] = w.linear(x[start:end])  # torch function is off here: the quantized linear directly
        start = max(start, end)
    return out


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
    tensors = [getattr(w, n) for n in w.qlayout.tensor_names]
    return _grouped_linear_op(x.contiguous(), offs, tensors, expert_spec(w))


register_status_rows(lambda: [{
    "layout": "(experts)", "linear": "torch._grouped_mm / torch.bmm on a quantized expert stack (E, N, K)",
    "path": "torchqkit::grouped_linear_quantized (per routed expert: its layout's linear row above)",
    "why": "no fused multi-expert kernel: one call of the layout's 2-d kernel per expert with tokens, empty groups "
           "skipped (Note [Grouped quantized linear])"}])
