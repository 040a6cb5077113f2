"""fuse_shared_input_linears: one quantized matmul where a module runs several Linears on the same input.

Note [Fused projections]: a LLaMA decoder layer runs q_proj, k_proj and v_proj on one input, and gate_proj and
up_proj on another. At decode (one token) each is a call of a few microseconds of fixed cost (Python, dispatch, the
op's checks and its parallel region) around a small weight: SmolLM2-135M's k_proj / v_proj are 192 x 576. Their
weights concatenated along out_features make one call that reads the same bytes: on the 2-vCPU EPYC, int4 g32 from
memory, the q/k/v rows took about half the time in one call as in three, gate/up about 0.85x
(benchmarks/RESULTS.md has both; python -m benchmarks decode --alternate with "+fused"
configs the whole step).

The fused weight is the members' codes, scales and zero points concatenated (the layout's unpack, then its pack),
checked to dequantize to exactly the members' weights (NF4 double quantization re-quantizes its scales per 256 when
it packs, so it is refused), and the members become views: each keeps a ``weight`` that is a slice of the fused
tensor (the layout's aliasing slice, no copy) and its forward takes its columns of the fused output. The output is
computed once per input: the first member called with a tensor runs the fused matmul, the others called with the
same tensor object take their part (a member called with another tensor runs the matmul for it; the result is the
same either way). The held output is dropped when the last member has taken its part. One model object, one
thread at a time: two threads running the same fused model at once could take each other's held output.

Members must agree on everything that decides the matmul: quantized weights of one layout, qdtype, block size, zero
point domain, dtype, activation quantization and kernel preference, the same in_features, all with a bias or none,
row counts the layout can cut at (whole tiles), and scales / zero points with one row per weight row. A group that
doesn't is left as it was and reported with the reason; nothing is fused silently or skipped silently.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layouts.base import PlainParts, WeightFormat
from ..tensor.affine_quantized_tensor import INPUT_SCALE, AffineQuantizedTensor

# Groups of attribute names a module runs on one input: LLaMA / Mistral / Qwen2 / Gemma attention and MLP, BERT's
# self-attention (in cross-attention its key / value take another input: still right, the matmul runs per input).
DEFAULT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))
_SAME = ("qdtype", "block_size", "orig_dtype", "qlayout", "zero_point_domain", "act_quant", "kernel_preference")


class FusedLinearGroup:
    """The fused weight (and bias) of a group of Linears, and the output of its last input."""

    def __init__(self, weight: AffineQuantizedTensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self._x: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] | None = None
        self._taken = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x.device != self.weight.device:
            raise RuntimeError(f"a fused projection's weight is on {self.weight.device}, its input on {x.device}: "
                               f"model.to() moves the members' views, not the fused weight; fuse after moving the "
                               f"model (torchqkit.fuse_shared_input_linears)")
        if self._x is not x:
            self._parts = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
            self._x, self._taken = x, 0
        out = self._parts[index]
        self._taken += 1
        if self._taken == len(self.sizes):  # every member has its part: hold no activation past this call
            self._x = self._parts = None
        return out


class FusedLinearMember(nn.Module):
    """One Linear of a fused group: its weight is a view of the group's, its output the group's columns."""

    def __init__(self, group: FusedLinearGroup, index: int, weight: AffineQuantizedTensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(x, self.index)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of "
                f"{len(self.group.sizes)} (fused)")


def _problem(linears: list) -> str | None:
    """Why these Linears can't share one fused weight, or None."""
    if not all(type(m) is nn.Linear for m in linears):
        return "not all plain nn.Linear"
    weights = [m.weight for m in linears]
    if not all(isinstance(w, AffineQuantizedTensor) and not w.transposed for w in weights):
        return "not all quantized (quantize_ first)"
    first = weights[0]
    for attr in _SAME:
        if any(getattr(w, attr) != getattr(first, attr) for w in weights):
            return f"their {attr} differ"
    if any(w.shape[1] != first.shape[1] for w in weights):
        return "their in_features differ"
    if len({m.bias is None for m in linears}) > 1:
        return "some have a bias and some don't"
    s0 = first.input_scale
    if not all(w.input_scale is s0 or (w.input_scale is not None and s0 is not None and torch.equal(w.input_scale, s0))
               for w in weights):
        return "their input scales (Note [Input scale]) differ"
    fmt = WeightFormat.of(first.qdtype, first.block_size, tuple(first.shape), first.zero_point_domain)
    cut = first.qlayout.slice_multiple(fmt, 0)
    if any(w.shape[0] % cut for w in weights[:-1]):
        return f"{type(first.qlayout).__name__} cuts out_features at multiples of {cut}"
    return None


def _fused_weight(weights: list[AffineQuantizedTensor]) -> AffineQuantizedTensor:
    first = weights[0]
    parts = [w.qlayout.unpack(w) for w in weights]
    n = sum(w.shape[0] for w in weights)
    for w, p in zip(weights, parts):
        for name, t in (("scale", p.scale), ("zero point", p.zero_point)):
            if t is not None and (t.dim() != 2 or t.shape[0] != w.shape[0]):
                raise ValueError(f"{name} of shape {tuple(t.shape)} is not one row per weight row")
    cat = PlainParts(torch.cat([p.qdata for p in parts]), torch.cat([p.scale for p in parts]),
                     None if parts[0].zero_point is None else torch.cat([p.zero_point for p in parts]),
                     None if parts[0].mask is None else torch.cat([p.mask for p in parts]))  # N:M: the same entries
    shape = (n, first.shape[1])
    fmt = WeightFormat.of(first.qdtype, first.block_size, shape, first.zero_point_domain)
    layout = first.qlayout
    tensors = layout.pack(cat, fmt)
    if first.input_scale is not None:  # one input, one scale: the members' (checked equal)
        tensors[INPUT_SCALE] = first.input_scale
    fused = AffineQuantizedTensor(tensors, first.qdtype, first.block_size, shape, first.orig_dtype,
                                  layout, first.zero_point_domain, act_quant=first.act_quant,
                                  kernel_preference=first.kernel_preference)
    # A layout that quantizes its scales again when packing (NF4 double quantization, per 256 scales) would give
    # the concatenation other weights: refuse rather than change the model.
    if not torch.equal(fused.dequantize(), torch.cat([w.dequantize() for w in weights])):
        raise ValueError(f"packing their concatenated codes changes the weights ({type(layout).__name__} re-quantizes "
                         f"its scales when it packs)")
    return fused


def fuse_shared_input_linears(model: nn.Module, groups=DEFAULT_GROUPS) -> dict[str, str]:
    """Fuse, in every module of ``model``, each group of quantized Linears that share an input into one matmul.

    For inference on a quantized model already on its device: a decoder layer's q/k/v projections (and gate/up)
    become one call on their concatenated weights, which saves the fixed cost of each call at decode. The members
    keep their names and shapes; each ``weight`` is a view of the fused one (``state_dict`` / ``save_quantized`` save
    them as ordinary weights), and each member's forward takes its columns of the fused output. Members must agree
    on everything that decides the matmul (layout, qdtype, block size, dtype, activation quantization, bias or
    none, ...); a group that doesn't is left as it was and reported with the reason.

    Args:
        model (torch.nn.Module): a quantized model, changed in place.
        groups (tuple[tuple[str, ...], ...]): the groups of Linear attribute names to fuse within a module;
            default ``(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))``. A
            group whose members don't all exist in a module is not a group there.

    Returns:
        dict[str, str]: ``{"<module>.q_proj+k_proj+v_proj": "fused" or "left as it was: <why>"}``, one entry per
            group found.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
        report = qk.fuse_shared_input_linears(model)
        print(report)   # {"model.layers.0.self_attn.q_proj+k_proj+v_proj": "fused", ...}
        ```
    """
    report = {}
    for name, module in list(model.named_modules()):
        for names in groups:
            linears = [getattr(module, n, None) for n in names]
            if any(m is None for m in linears):
                continue
            key = f"{name + '.' if name else ''}{'+'.join(names)}"
            why = _problem(linears)
            if why is None:
                try:
                    fused = _fused_weight([m.weight for m in linears])
                except ValueError as e:
                    why = str(e)
            if why is not None:
                report[key] = f"left as it was: {why}"
                continue
            sizes = [m.out_features for m in linears]
            bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
            group = FusedLinearGroup(fused, bias, sizes)
            start = 0
            for i, (n, m) in enumerate(zip(names, linears)):
                view = fused[start:start + sizes[i]]
                b = None if bias is None else bias[start:start + sizes[i]]
                setattr(module, n, FusedLinearMember(group, i, view, b))
                start += sizes[i]
            report[key] = "fused"
    return report
