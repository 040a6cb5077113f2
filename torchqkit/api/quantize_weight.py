"""quantize_weight: float tensor -> AffineQuantizedTensor (the step every config handler shares)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..algorithms import check_algorithm, hqq_qparams
from ..core.calibration import parse_calibration
from ..core.granularity import Granularity, validate_block_size
from ..core.primitives import (FLOAT8_E4M3, MappingType, ZeroPointDomain, choose_qparams_affine,
                               default_zero_point_domain, quantize_affine)
from ..core.qdtype import QDType
from ..layouts.base import Layout, PlainParts, WeightFormat
from ..tensor.activation import ActivationQuantSpec, KernelPreference
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor

__all__ = ["quantize_weight", "weight_qparams", "WeightQParams", "WeightRecipe", "UnsupportedWeightError", "UnsupportedWeight"]


class UnsupportedWeightError(ValueError):
    """A config or layout can't take this weight (its shape, dtype, values or format).

    Raised by ``quantize_weight`` (and the config handlers ``quantize_`` calls): a weight that is already
    quantized, not floating point or not 2-d, a block size that can't tile it, a layout that can't store the
    format, a calibrated config given no calibration. ``quantize_`` catches it and reports the layer as
    ``"skipped"`` with the reason (``strict=True`` turns that into ``QuantizationError``). A ``ValueError``;
    ``UnsupportedWeight`` is its earlier name, kept for code that catches it.

    Example:
        ```python
        import torch
        import torchqkit as qk
        try:
            qk.quantize_weight(torch.randn(4, 4, 4), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout())
        except qk.UnsupportedWeightError as e:
            print(e)           # weight has 3 dims; quantized weights are 2-d (out, in)
        ```
    """


UnsupportedWeight = UnsupportedWeightError  # the earlier name, kept for code that catches it


class WeightQParams(NamedTuple):
    """What quantizing one weight decided before its codes: the block size, zero-point domain and qparams."""
    block_size: tuple[int, ...]
    zero_point_domain: ZeroPointDomain
    scale: torch.Tensor
    zero_point: torch.Tensor | None


@dataclass(frozen=True)
class WeightRecipe:
    """What a config decides for every weight it quantizes: ``quantize_weight``'s arguments besides the weight
    and the per-call rounding options. A config registered with a recipe (``register_recipe_config``) quantizes
    through it, and training fake-quantizes with the same recipe, so both follow one description of the format.

    ``algorithm`` chooses the qparams: "rtn" is ``choose_qparams_affine`` (min-max / absmax ranges,
    ``calibration`` and ``scale_rounding`` apply); "hqq" is ``hqq_qparams``: integer codes with an asymmetric
    mapping and a zero point (FLOAT or INT domain) optimised without calibration data. The codes are
    ``quantize_affine`` of those qparams either way."""
    qdtype: QDType
    granularity: Granularity | tuple
    layout: Layout
    mapping: MappingType = MappingType.SYMMETRIC
    zero_point_domain: ZeroPointDomain | None = None
    scale_dtype: torch.dtype | None = None
    scale_rounding: str | None = None
    act_quant: ActivationQuantSpec | None = None
    kernel_preference: KernelPreference = KernelPreference.AUTO
    algorithm: str = "rtn"
    calibration: str | None = None

    @property
    def blockwise(self) -> bool:
        """Whether each block's stored qparams depend on that block's values alone, so that one ``qparams(stack,
        experts=True)`` call on a stack of experts (E, N, K) chooses what quantizing each expert on its own
        would. Not so for HQQ (its stopping rule sums the error of the whole weight), float8_e4m3 scale rounding
        (one power-of-two global scale per weight) and a layout that stores its scales lossily (NF4's double
        quantization: statistics over all of a weight's scales); nor, to be bit-exact, for "rms" ranges (a sum
        over a block, which a differently shaped reduction may add in another order; min / max are exact)."""
        return (self.algorithm == "rtn" and self.scale_rounding != FLOAT8_E4M3
                and (self.calibration is None or parse_calibration(self.calibration).method != "rms")
                and type(self.layout).stored_scale is Layout.stored_scale)

    def qparams(self, weight: torch.Tensor, *, check_finite: bool = True, stochastic: bool = False,
                name: str = "weight", experts: bool = False) -> WeightQParams:
        return weight_qparams(weight, self, check_finite=check_finite, stochastic=stochastic, name=name,
                              experts=experts)

    def quantize(self, weight: torch.Tensor, name: str = "weight", *, stochastic: bool = False,
                 generator: torch.Generator | None = None, check_finite: bool = True) -> AffineQuantizedTensor:
        """Quantize one float weight into ``self.layout``: ``qparams``, the oracle's codes, the layout's packing."""
        qp = self.qparams(weight, check_finite=check_finite, stochastic=stochastic, name=name)
        codes = quantize_affine(weight.detach(), self.qdtype, qp.block_size, qp.scale, qp.zero_point,
                                zero_point_domain=qp.zero_point_domain, stochastic=stochastic, generator=generator,
                                check_finite=False, name=name)
        fmt = WeightFormat.of(self.qdtype, qp.block_size, weight.shape, qp.zero_point_domain)
        layout = self.layout.for_weight(fmt)
        parts = PlainParts(codes, qp.scale, qp.zero_point)
        problem = None if codes.is_meta else layout.kernel_range_problem(parts, fmt, self.act_quant)  # meta: no values
        if problem is not None:
            raise UnsupportedWeight(f"{name}: {problem}")
        tensors = layout.pack(parts, fmt)
        return AffineQuantizedTensor(tensors, self.qdtype, qp.block_size, tuple(weight.shape), weight.dtype,
                                     layout, qp.zero_point_domain, act_quant=self.act_quant,
                                     kernel_preference=self.kernel_preference)


def weight_qparams(weight: torch.Tensor, recipe: WeightRecipe, *, check_finite: bool = True, stochastic: bool = False,
                   name: str = "weight", experts: bool = False) -> WeightQParams:
    """Check that ``recipe.layout`` can store ``weight`` the recipe's way and choose its qparams: the first half of
    ``quantize_weight`` (the codes are ``quantize_affine`` of the result). Fake quantization for training
    calls it too, so fake and real weights share one decision. Raises UnsupportedWeight with the reason.
    ``experts=True``: ``weight`` is a stack of experts (E, N, K), checked as one (N, K) weight, whose qparams
    (block size (1, bn, bk)) are each expert's own; only for a ``recipe.blockwise`` recipe."""
    check_algorithm(name, recipe.algorithm)
    if isinstance(weight, AffineQuantizedTensor):
        raise UnsupportedWeight(f"{name} is already quantized ({weight!r})")
    if not weight.dtype.is_floating_point:
        raise UnsupportedWeight(f"{name} has dtype {weight.dtype}; only floating weights can be quantized")
    if weight.dim() != (3 if experts else 2):
        raise UnsupportedWeight(f"{name} has {weight.dim()} dims; quantized weights are 2-d (out, in)"
                                + (" and stacks of experts 3-d (experts, out, in)" if experts else ""))
    if experts and not recipe.blockwise:
        raise ValueError(f"{name}: this recipe's qparams depend on more than one block (see WeightRecipe.blockwise); "
                         f"choose them expert by expert")
    shape = tuple(weight.shape[1:] if experts else weight.shape)
    g = recipe.granularity
    block_size = tuple(g) if isinstance(g, tuple) else g.block_size(shape)
    reason = validate_block_size(shape, block_size)
    if reason is not None:
        raise UnsupportedWeight(f"{name} of shape {shape} can't use block_size {block_size}: {reason}")
    mapping = MappingType(recipe.mapping)
    if recipe.algorithm == "hqq":
        _check_hqq(mapping, recipe.calibration, recipe.scale_rounding, stochastic, name)
    zpd = ZeroPointDomain(recipe.zero_point_domain if recipe.zero_point_domain is not None
                          else default_zero_point_domain(recipe.qdtype, mapping))
    reason = recipe.layout.supports(WeightFormat.of(recipe.qdtype, block_size, shape, zpd))
    if reason is not None:
        raise UnsupportedWeight(f"{name}: {reason}")
    if experts:
        block_size = (1, *block_size)
    w = weight.detach()
    if recipe.algorithm == "hqq":
        scale, zero_point = hqq_qparams(w, recipe.qdtype, block_size, zero_point_domain=zpd,
                                        scale_dtype=recipe.scale_dtype, check_finite=check_finite, name=name)
    else:
        scale, zero_point = choose_qparams_affine(w, recipe.qdtype, block_size, mapping=mapping, zero_point_domain=zpd,
                                                  calibration=recipe.calibration, scale_dtype=recipe.scale_dtype,
                                                  scale_rounding=recipe.scale_rounding, check_finite=check_finite,
                                                  name=name)
    return WeightQParams(block_size, zpd, scale, zero_point)


def quantize_weight(
    weight: torch.Tensor,
    qdtype: QDType,
    granularity: Granularity | tuple,
    layout: Layout,
    *,
    mapping: MappingType = MappingType.SYMMETRIC,
    zero_point_domain=None,
    calibration: str | None = None,
    scale_dtype: torch.dtype | None = None,
    scale_rounding: str | None = None,
    act_quant: ActivationQuantSpec | None = None,
    kernel_preference: KernelPreference = KernelPreference.AUTO,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    check_finite: bool = True,
    algorithm: str = "rtn",
    name: str = "weight",
) -> AffineQuantizedTensor:
    """Quantize one float weight into ``layout``: the step every config's handler shares.

    Chooses the qparams (``choose_qparams_affine``, or HQQ), computes the codes with ``quantize_affine``, and packs
    them into ``layout``, returning the ``AffineQuantizedTensor`` that ``quantize_`` would install. Use it to
    quantize a single tensor, or to build formats no config offers.

    Args:
        weight (torch.Tensor): a 2-d floating (N, K) weight.
        qdtype (QDType): the code format, e.g. ``qk.qdtypes.int8`` or ``qk.qdtypes.uint4``.
        granularity (Granularity | tuple): a granularity (``PerRow()``, ``PerGroup(32)``, ...) or an explicit
            block size tuple.
        layout (Layout): where the codes are stored (``PlainLayout()``, ``TensorCoreTiledLayout()``, ...).
        mapping (MappingType): ``SYMMETRIC`` (default), ``SYMMETRIC_NO_CLIPPING_ERR`` or ``ASYMMETRIC``, or its
            value. Keyword-only, as are the arguments below.
        zero_point_domain (ZeroPointDomain | str | None): None (default): chosen from qdtype and mapping; or
            ``NONE`` / ``INT`` / ``FLOAT`` (or its value).
        calibration (str | None): the range method of ``choose_qparams_affine`` (``"absmax"``, ``"minmax"``,
            ``"rms,3"``, ...); None (default): its default. With ``algorithm="hqq"`` only None or ``"minmax"``.
        scale_dtype (torch.dtype | None): dtype of the scales and zero points; None (default): the weight's dtype.
        scale_rounding (str | None): None (default), ``"power_of_two"`` (MX scales) or ``"float8_e4m3"`` (NVFP4's
            float8 block scales under a per-tensor power of two).
        act_quant (ActivationQuantSpec | None): how the linear quantizes its input; None (default): it doesn't.
        kernel_preference (KernelPreference): which implementation serves the ops; default ``KernelPreference.AUTO``.
        stochastic (bool): stochastic rounding of integer codes (needs ``generator``); default False.
        generator (torch.Generator | None): the seeded generator for stochastic rounding; default None.
        check_finite (bool): refuse NaN / Inf weights; default True.
        algorithm (str): ``"rtn"`` (default) or ``"hqq"`` (asymmetric mapping only, no calibration, scale rounding
            or stochastic rounding).
        name (str): the weight's name in error messages; default ``"weight"``.

    Returns:
        AffineQuantizedTensor: the quantized weight, with ``weight``'s shape and dtype.

    Raises:
        UnsupportedWeightError: the weight is already quantized, not floating point or not 2-d, the block size
            can't tile it, or ``layout`` can't store the format (or its kernels could overflow on these qparams).
        ValueError: an unknown algorithm, an option HQQ refuses, NaN / Inf values (with ``check_finite``), or a
            scheme the qdtype can't take.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = torch.randn(64, 256)
        qw = qk.quantize_weight(w, qk.qdtypes.uint4, qk.PerGroup(32), qk.PlainLayout(), mapping="asymmetric",
                                zero_point_domain="float")
        print(qw, (qw.dequantize() - w).abs().max())
        ```
    """
    recipe = WeightRecipe(qdtype, granularity, layout, mapping=mapping, zero_point_domain=zero_point_domain,
                          scale_dtype=scale_dtype, scale_rounding=scale_rounding, act_quant=act_quant,
                          kernel_preference=kernel_preference, algorithm=algorithm, calibration=calibration)
    return recipe.quantize(weight, name, stochastic=stochastic, generator=generator, check_finite=check_finite)


def _check_hqq(mapping, calibration, scale_rounding, stochastic, name) -> None:
    """HQQ fixes what round-to-nearest leaves open: the range (min-max), the mapping, the rounding."""
    if mapping is not MappingType.ASYMMETRIC:
        raise ValueError(f"{name}: algorithm='hqq' optimises an asymmetric zero point; pass "
                         f"mapping=MappingType.ASYMMETRIC, not {mapping.value}")
    if calibration not in (None, "minmax") or scale_rounding is not None or stochastic:
        raise ValueError(f"{name}: algorithm='hqq' starts from min-max ranges and rounds to nearest; it takes no "
                         f"calibration={calibration!r}, scale_rounding={scale_rounding!r} or stochastic rounding")
