"""Adding a float update into a quantized weight in place: dequantize, add, quantize again into the same format.

Note [Merging into a quantized weight]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Merging a LoRA adapter (PEFT's ``merge_and_unload``; ``unmerge`` subtracts) runs ``base.weight.data += delta`` on
the frozen base weight: ``aten.add_`` / ``aten.sub_`` on an alias of the Parameter. An adapter can't be folded into
codes exactly, so these two ops, and only these, compute ``w.dequantize() + alpha * delta`` in float32 and quantize
the sum again, round-to-nearest, into the weight's own format: the same qdtype, block size, zero-point domain,
scale dtype, layout, activation quantization, kernel preference and input scale. The qparams are chosen the way the
configs' recipes choose them: min-max with a zero point where the format stores zero points (asymmetric), absmax
otherwise, power-of-two scales where the layout says so (``Layout.scale_rounding``). What a calibrated algorithm
chose (GPTQ's codes, HQQ's optimised zero points, a clipping calibration) is not redone: the merged weight is a
round-to-nearest one. The new packed tensors are copied into the existing ones, which the Parameter shares with
the alias PEFT writes to; they have the same shapes because the format is the same. Anything that fails (a
non-finite sum, a format whose kernel can't take the new qparams) raises before any byte is written, naming the
layout, so the weight is left as it was.
"""
from __future__ import annotations

import torch

from ..core.primitives import MappingType, ZeroPointDomain, choose_qparams_affine, quantize_affine
from ..layouts.base import PlainParts
from .affine_quantized_tensor import AffineQuantizedTensor

__all__ = ["add_into_"]


def add_into_(weight: AffineQuantizedTensor, update, alpha=1, op: str = "add_") -> AffineQuantizedTensor:
    """``weight += alpha * update`` in place, quantized again in ``weight``'s format (Note [Merging into a quantized
    weight]). ``update`` is a float tensor of ``weight``'s outer shape (or broadcastable to it) or a number."""
    where = f"{op} into a quantized weight ({type(weight.qlayout).__name__}, {weight.qdtype.name})"
    if isinstance(update, AffineQuantizedTensor):
        raise TypeError(f"{where}: the update is quantized too; add a float tensor (e.g. update.dequantize())")
    if isinstance(update, torch.Tensor) and not update.dtype.is_floating_point:
        raise TypeError(f"{where}: the update has dtype {update.dtype}; a float update is needed")
    if isinstance(update, torch.Tensor) and not _broadcasts_to(update.shape, weight.shape):
        raise ValueError(f"{where}: an update of shape {tuple(update.shape)} doesn't fit the weight's shape "
                         f"{tuple(weight.shape)}")
    merged = weight.dequantize(torch.float32) + alpha * (update.float() if isinstance(update, torch.Tensor)
                                                         else update)
    if weight.transposed:
        merged = merged.t()
    if weight.input_scale is not None:  # the codes hold w / input_scale (Note [Input scale])
        merged = merged / weight.input_scale.float()
    if not torch.isfinite(merged).all():
        raise ValueError(f"{where}: the sum has NaN or Inf values; the weight was left unchanged")
    new = _quantize_like(weight, merged.to(weight.orig_dtype), where)
    for name, new_t in new.items():
        old_t = getattr(weight, name)
        if (old_t is None) != (new_t is None) or (old_t is not None and (old_t.shape != new_t.shape
                                                                         or old_t.dtype != new_t.dtype)):
            raise ValueError(f"{where}: quantizing the sum again stores {name} differently ("
                             f"{_describe(new_t)} instead of {_describe(old_t)}); this layout can't be merged into "
                             f"in place: merge into the float model, then quantize it")
    for name, new_t in new.items():
        if new_t is not None:
            getattr(weight, name).copy_(new_t)
    return weight


def _quantize_like(weight: AffineQuantizedTensor, w: torch.Tensor, where: str) -> dict:
    """The layout's packed tensors of ``w`` (logical shape, orig dtype) in ``weight``'s format."""
    layout, fmt = weight.qlayout, weight.weight_format
    stored = layout.unpack(weight)
    zpd = ZeroPointDomain(weight.zero_point_domain)
    mapping = MappingType.SYMMETRIC if stored.zero_point is None else MappingType.ASYMMETRIC
    scale, zero_point = choose_qparams_affine(
        w, weight.qdtype, weight.block_size, mapping=mapping, zero_point_domain=zpd, scale_dtype=stored.scale.dtype,
        zero_point_dtype=None if stored.zero_point is None else stored.zero_point.dtype,
        scale_rounding=layout.scale_rounding, name=where)
    codes = quantize_affine(w, weight.qdtype, weight.block_size, scale, zero_point, zero_point_domain=zpd,
                            check_finite=False, name=where)
    parts = PlainParts(codes, scale, zero_point)
    problem = layout.kernel_range_problem(parts, fmt, weight.act_quant)
    if problem is not None:
        raise ValueError(f"{where}: the merged weight can't be stored: {problem}")
    return layout.pack(parts, fmt)  # the layout's tensors only: an input_scale stays as it is


def _broadcasts_to(shape, target) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


def _describe(t) -> str:
    return "nothing" if t is None else f"{tuple(t.shape)} {t.dtype}"
