"""Pruned weights for SparsityConfig: a mask (magnitude, Wanda or SparseGPT), then the kept values or their base
codes packed into NMSparseLayout.

Note [Sparse qparams]
~~~~~~~~~~~~~~~~~~~~~
The layout stores only the kept entries, so a base config's scales and zero points should fit them, not the zeros
pruning leaves: before qparams are chosen, each pruned entry is replaced by a kept value of its block of M
(algorithms/nm_masks.fill_pruned), which leaves a group's min, max and absmax those of its kept values (the range
methods only see extremes; an "rms" calibration sees a few duplicates). The codes are then the oracle's
quantize_affine of the pruned weight on those qparams, and the pruned entries' codes are never stored.
"""
from __future__ import annotations

import dataclasses

import torch

from ..algorithms.nm_masks import fill_pruned, magnitude_scores, nm_prune_mask, wanda_scores
from ..algorithms.sparsegpt import sparsegpt
from ..core.granularity import PerRow
from ..core.primitives import quantize_affine
from ..core.qdtype import float_qdtype
from ..layouts.base import PlainParts, WeightFormat
from ..layouts.nm_sparse import NMSparseLayout
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .calibration_grid import ConfigGrid
from .configs.base import recipe_for
from .quantize_weight import UnsupportedWeight, WeightRecipe

__all__ = ["magnitude_sparse_weight", "calibrated_sparse_weight", "sparse_recipe"]


def sparse_recipe(config, weight: torch.Tensor, name: str) -> WeightRecipe:
    """How a SparsityConfig stores ``weight``'s kept values: the base's recipe in NMSparseLayout, or (no base) the
    float values themselves (Note [Float identity codes], core/qdtype.py), one unit scale per row."""
    layout = NMSparseLayout(*config.pattern)
    if config.base is not None:
        return dataclasses.replace(recipe_for(config.base), layout=layout)
    try:
        qdtype = float_qdtype(weight.dtype)
    except ValueError as e:
        raise UnsupportedWeight(f"{name}: {e}") from None
    return WeightRecipe(qdtype, PerRow(), layout, kernel_preference=config.kernel_preference)


def _check_weight(weight, name: str) -> None:
    """What quantize_weight refuses, refused before any mask is computed."""
    if isinstance(weight, AffineQuantizedTensor):
        raise UnsupportedWeight(f"{name} is already quantized ({weight!r})")
    if not weight.dtype.is_floating_point or weight.dim() != 2:
        raise UnsupportedWeight(f"{name} is a {weight.dtype} tensor of shape {tuple(weight.shape)}; pruning takes a "
                                f"2-d (out, in) float weight")


def magnitude_sparse_weight(config, weight: torch.Tensor, name: str) -> AffineQuantizedTensor:
    """``weight`` pruned to its largest magnitudes per block (SparsityConfig's handler without calibration data)."""
    _check_weight(weight, name)
    n, m = config.pattern
    return sparse_weight(config, weight, nm_prune_mask(magnitude_scores(weight), n, m), name)


def calibrated_sparse_weight(config, weight: torch.Tensor, stats, name: str) -> AffineQuantizedTensor:
    """``weight`` pruned by Wanda or SparseGPT from the statistics of its inputs (algorithms/observers.InputStats,
    with the Hessian for SparseGPT)."""
    _check_weight(weight, name)
    n, m = config.pattern
    if config.method == "wanda":
        return sparse_weight(config, weight, nm_prune_mask(wanda_scores(weight, stats.sq_sum), n, m), name)
    if config.base is None:
        result = sparsegpt(weight, stats.hessian.h, n, m, damp=config.damp, block=config.block, name=name)
        return sparse_weight(config, result.weight.to(weight.dtype), result.mask, name)
    grid = ConfigGrid(config.base, weight, name)  # the base config's grid, as GPTQ uses it
    result = sparsegpt(weight, stats.hessian.h, n, m, grid, damp=config.damp, block=config.block, name=name)
    probe = grid.probe
    recipe = sparse_recipe(config, weight, name)
    codes = result.codes.to(probe.qdtype.storage_dtype)
    return pack_sparse(recipe, weight, PlainParts(codes, result.scale, result.zero_point, result.mask),
                       probe.block_size, probe.zero_point_domain, name)


def sparse_weight(config, weight: torch.Tensor, mask: torch.Tensor, name: str) -> AffineQuantizedTensor:
    """The values of ``weight`` where ``mask`` is True, in ``config``'s format (Note [Sparse qparams])."""
    recipe = sparse_recipe(config, weight, name)
    pruned = torch.where(mask, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
    qp = recipe.qparams(fill_pruned(pruned, mask, config.pattern[1]), name=name)
    codes = quantize_affine(pruned, recipe.qdtype, qp.block_size, qp.scale, qp.zero_point,
                            zero_point_domain=qp.zero_point_domain, check_finite=False, name=name)
    return pack_sparse(recipe, weight, PlainParts(codes, qp.scale, qp.zero_point, mask), qp.block_size,
                       qp.zero_point_domain, name)


def pack_sparse(recipe: WeightRecipe, weight: torch.Tensor, parts: PlainParts, block_size, zero_point_domain,
                name: str) -> AffineQuantizedTensor:
    """``parts`` (codes, qparams and the mask of kept entries) packed into the recipe's NMSparseLayout."""
    fmt = WeightFormat.of(recipe.qdtype, block_size, weight.shape, zero_point_domain)
    layout = recipe.layout.for_weight(fmt)
    problem = layout.supports(fmt)
    if problem is not None:
        raise UnsupportedWeight(f"{name}: {problem}")
    tensors = layout.pack(parts, fmt)
    return AffineQuantizedTensor(tensors, recipe.qdtype, fmt.block_size, tuple(weight.shape), weight.dtype, layout,
                                 fmt.zero_point_domain, act_quant=recipe.act_quant,
                                 kernel_preference=recipe.kernel_preference)
