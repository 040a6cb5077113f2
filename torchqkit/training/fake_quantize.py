"""Fake quantization: quantize then dequantize with the oracle, in the forward pass, differentiably.

A weight's fake quantization is the dequantization of what ``quantize_weight`` would store for it (same
``WeightRecipe``, same ``weight_qparams``, the layout's ``stored_scale``), so a converted layer computes
with exactly the weights the last training forward used. Gradients pass straight through (STE), or, with
"clipped_ste", only where the value lay inside the representable range (see Note [Clipped STE]).
"""
from __future__ import annotations

import torch

from ..api.quantize_weight import WeightRecipe
from ..core.primitives import ZeroPointDomain, dequantize_affine, quantize_affine
from ..core.qdtype import QDType, QKind
from ..tensor.activation import ActivationQuantSpec

__all__ = ["WeightFakeQuantizer", "fake_quantize_activation"]


# Note [Clipped STE]
# ~~~~~~~~~~~~~~~~~~
# A quantizer maps every x of a block onto its grid [lo, hi], where lo / hi are the dequantized first and last
# codes with that block's qparams (for a codebook: its smallest and largest level). Inside [lo, hi] rounding
# moves x by at most half a step and the STE's gradient of 1 is the useful lie; outside, x was clipped, and
# moving it further out changes nothing in the forward, so "clipped_ste" gives it gradient 0 (qwix's
# clip_gradient_to_calibration). With min-max / absmax scales almost nothing clips (a symmetric signed grid
# holds -amax but not +amax's half step beyond qmax); static activation scales and rms-clipped ranges do.

def _extreme_codes(qdtype: QDType) -> tuple[float, float]:
    if qdtype.kind is QKind.CODEBOOK:
        levels = qdtype.levels
        return float(levels.index(min(levels))), float(levels.index(max(levels)))
    return float(qdtype.qmin), float(qdtype.qmax)


def inside_grid(x: torch.Tensor, codes: torch.Tensor, qdtype: QDType, block_size, scale: torch.Tensor,
                zero_point: torch.Tensor | None, zero_point_domain: ZeroPointDomain) -> torch.Tensor:
    """Mask of the elements of ``x`` its quantizer did not clip: lo <= x <= hi, see Note [Clipped STE]."""
    first, last = _extreme_codes(qdtype)
    edges = [dequantize_affine(torch.full_like(codes, c), qdtype, block_size, scale, zero_point,
                               zero_point_domain=zero_point_domain, output_dtype=torch.float32)
             for c in (first, last)]
    xf = x.float()
    return (xf >= edges[0]) & (xf <= edges[1])


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized values, exactly. Backward: the gradient as it is, or masked by ``inside``."""

    @staticmethod
    def forward(ctx, x, fake, inside):
        ctx.masked = inside is not None
        if ctx.masked:
            ctx.save_for_backward(inside)
        return fake

    @staticmethod
    def backward(ctx, grad):
        if ctx.masked:
            (inside,) = ctx.saved_tensors
            grad = grad * inside.to(grad.dtype)
        return grad, None, None


class WeightFakeQuantizer:
    """Fake-quantizes one layer's weight with a config's WeightRecipe.

    clipped: use the clipped-STE gradient. generator: a seeded torch.Generator for stochastic rounding
    (integer formats), or None to round to nearest as ``quantize_weight`` does."""

    def __init__(self, recipe: WeightRecipe, *, clipped: bool = False, generator: torch.Generator | None = None,
                 name: str = "weight"):
        self.recipe, self.clipped, self.generator, self.name = recipe, clipped, generator, name

    def values(self, weight: torch.Tensor, qparams_from: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fake-quantized weight in weight.dtype, inside-grid mask or None when not clipped), no autograd.
        weight: (N, K), or a stack of experts (E, N, K), each expert fake-quantized on its own (Note
        [Fake-quantized experts]). qparams_from: the tensor the scales and zero points are chosen on (default the
        weight itself; sparse training passes the masked weight with its pruned entries filled, Note [Sparse
        qparams])."""
        if weight.dim() == 3 and not self.recipe.blockwise:  # statistics over a whole expert: one at a time
            parts = [self._values(w, None, f"{self.name}[{e}]") for e, w in enumerate(weight.unbind(0))]
            fake = torch.stack([p[0] for p in parts])
            return fake, (torch.stack([p[1] for p in parts]) if self.clipped else None)
        return self._values(weight, qparams_from, self.name)

    def _values(self, weight: torch.Tensor, qparams_from: torch.Tensor | None, name: str):
        r = self.recipe
        w = weight.detach()
        # check_finite=False: a finiteness check is a data-dependent branch (a graph break under torch.compile);
        # a NaN weight shows up in the loss anyway.
        source = w if qparams_from is None else qparams_from.detach()
        qp = r.qparams(source, check_finite=False, stochastic=self.generator is not None, name=name,
                       experts=w.dim() == 3)
        codes = quantize_affine(w, r.qdtype, qp.block_size, qp.scale, qp.zero_point,
                                zero_point_domain=qp.zero_point_domain, stochastic=self.generator is not None,
                                generator=self.generator, check_finite=False, name=name)
        scale = r.layout.stored_scale(qp.scale)  # what the layout keeps (NF4 double quantization rounds it)
        fake = dequantize_affine(codes, r.qdtype, qp.block_size, scale, qp.zero_point,
                                 zero_point_domain=qp.zero_point_domain, output_dtype=weight.dtype, name=name)
        inside = None
        if self.clipped:
            inside = inside_grid(w, codes, r.qdtype, qp.block_size, scale, qp.zero_point, qp.zero_point_domain)
        return fake, inside

    def __call__(self, weight: torch.Tensor, qparams_from: torch.Tensor | None = None) -> torch.Tensor:
        fake, inside = self.values(weight, qparams_from)
        return _StraightThrough.apply(weight, fake, inside)


def fake_quantize_activation(x: torch.Tensor, spec: ActivationQuantSpec, *, clipped: bool = False) -> torch.Tensor:
    """``spec.fake_quantize`` of x (..., K) token by token as the quantized linear does it, with an STE gradient."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    qa = spec.quantize(x2d)
    fake = spec.dequantize(qa, x.dtype).reshape(x.shape)
    inside = None
    if clipped:
        zpd = ZeroPointDomain.NONE if qa.zero_point is None else ZeroPointDomain.INT
        inside = inside_grid(x2d, qa.qdata, spec.qdtype, spec.block_size(x2d), qa.scale, qa.zero_point,
                             zpd).reshape(x.shape)
    return _StraightThrough.apply(x, fake, inside)
