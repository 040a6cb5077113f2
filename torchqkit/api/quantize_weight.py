"""quantize_weight: float tensor -> AffineQuantizedTensor (the step every config handler shares)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..algorithms import check_algorithm, hqq_qparams
from ..core.granularity import Granularity, validate_block_size
from ..core.primitives import (MappingType, ZeroPointDomain, choose_qparams_affine, default_zero_point_domain,
                               quantize_affine)
from ..core.qdtype import QDType
from ..layouts.base import Layout, PlainParts, WeightFormat
from ..tensor.activation import ActivationQuantSpec, KernelPreference
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor

__all__ = ["quantize_weight", "weight_qparams", "WeightQParams", "WeightRecipe", "UnsupportedWeight"]


class UnsupportedWeight(ValueError):
    """A config or layout can't take this weight (shape, dtype); quantize_ reports the reason."""


class WeightQParams(NamedTuple):
    """What quantizing one weight decided before its codes: the block size, zero-point domain and qparams."""
    block_size: tuple[int, ...]
    zero_point_domain: ZeroPointDomain
    scale: torch.Tensor
    zero_point: torch.Tensor | None


def weight_qparams(
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
    stochastic: bool = False,
    check_finite: bool = True,
    algorithm: str = "rtn",
    name: str = "weight",
) -> WeightQParams:
    """Check that ``layout`` can store ``weight`` this way and choose its qparams: the first half of
    ``quantize_weight`` (the codes are ``quantize_affine`` of the result). Fake quantization for training
    calls it too, so fake and real weights share one decision. Raises UnsupportedWeight with the reason."""
    check_algorithm(name, algorithm)
    if isinstance(weight, AffineQuantizedTensor):
        raise UnsupportedWeight(f"{name} is already quantized ({weight!r})")
    if not weight.dtype.is_floating_point:
        raise UnsupportedWeight(f"{name} has dtype {weight.dtype}; only floating weights can be quantized")
    if weight.dim() != 2:
        raise UnsupportedWeight(f"{name} has {weight.dim()} dims; quantized weights are 2-d (out, in)")
    block_size = tuple(granularity) if isinstance(granularity, tuple) else granularity.block_size(tuple(weight.shape))
    reason = validate_block_size(weight.shape, block_size)
    if reason is not None:
        raise UnsupportedWeight(f"{name} of shape {tuple(weight.shape)} can't use block_size {block_size}: {reason}")
    mapping = MappingType(mapping)
    if algorithm == "hqq":
        _check_hqq(mapping, calibration, scale_rounding, stochastic, name)
    zpd = ZeroPointDomain(zero_point_domain if zero_point_domain is not None
                          else default_zero_point_domain(qdtype, mapping))
    reason = layout.supports(WeightFormat.of(qdtype, block_size, weight.shape, zpd))
    if reason is not None:
        raise UnsupportedWeight(f"{name}: {reason}")
    w = weight.detach()
    if algorithm == "hqq":
        scale, zero_point = hqq_qparams(w, qdtype, block_size, zero_point_domain=zpd, scale_dtype=scale_dtype,
                                        check_finite=check_finite, name=name)
    else:
        scale, zero_point = choose_qparams_affine(w, qdtype, block_size, mapping=mapping, zero_point_domain=zpd,
                                                  calibration=calibration, scale_dtype=scale_dtype,
                                                  scale_rounding=scale_rounding, check_finite=check_finite,
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
    """Quantize one float weight into ``layout``.

    ``algorithm`` chooses the qparams: "rtn" is ``choose_qparams_affine`` (min-max / absmax ranges,
    ``calibration`` and ``scale_rounding`` apply); "hqq" is ``hqq_qparams``: integer codes with an
    asymmetric mapping and a zero point (FLOAT or INT domain) optimised without calibration data.
    The codes are ``quantize_affine`` of those qparams either way (see ``weight_qparams``)."""
    qp = weight_qparams(weight, qdtype, granularity, layout, mapping=mapping, zero_point_domain=zero_point_domain,
                        calibration=calibration, scale_dtype=scale_dtype, scale_rounding=scale_rounding,
                        stochastic=stochastic, check_finite=check_finite, algorithm=algorithm, name=name)
    codes = quantize_affine(weight.detach(), qdtype, qp.block_size, qp.scale, qp.zero_point,
                            zero_point_domain=qp.zero_point_domain, stochastic=stochastic, generator=generator,
                            check_finite=False, name=name)
    tensors = layout.pack(PlainParts(codes, qp.scale, qp.zero_point),
                          WeightFormat.of(qdtype, qp.block_size, weight.shape, qp.zero_point_domain))
    return AffineQuantizedTensor(tensors, qdtype, qp.block_size, tuple(weight.shape), weight.dtype, layout,
                                 qp.zero_point_domain, act_quant=act_quant, kernel_preference=kernel_preference)


@dataclass(frozen=True)
class WeightRecipe:
    """What a config decides for every weight it quantizes: ``quantize_weight``'s arguments besides the
    weight. A config registered with a recipe (``register_recipe_config``) quantizes through it, and training
    fake-quantizes with the same recipe, so both follow one description of the format."""
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

    def qparams(self, weight: torch.Tensor, *, check_finite: bool = True, stochastic: bool = False,
                name: str = "weight") -> WeightQParams:
        return weight_qparams(weight, self.qdtype, self.granularity, self.layout, mapping=self.mapping,
                              zero_point_domain=self.zero_point_domain, scale_dtype=self.scale_dtype,
                              scale_rounding=self.scale_rounding, stochastic=stochastic,
                              check_finite=check_finite, algorithm=self.algorithm, name=name)

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> AffineQuantizedTensor:
        return quantize_weight(weight, self.qdtype, self.granularity, self.layout, mapping=self.mapping,
                               zero_point_domain=self.zero_point_domain, scale_dtype=self.scale_dtype,
                               scale_rounding=self.scale_rounding, act_quant=self.act_quant,
                               kernel_preference=self.kernel_preference, algorithm=self.algorithm, name=name)


def _check_hqq(mapping, calibration, scale_rounding, stochastic, name) -> None:
    """HQQ fixes what round-to-nearest leaves open: the range (min-max), the mapping, the rounding."""
    if mapping is not MappingType.ASYMMETRIC:
        raise ValueError(f"{name}: algorithm='hqq' optimises an asymmetric zero point; pass "
                         f"mapping=MappingType.ASYMMETRIC, not {mapping.value}")
    if calibration not in (None, "minmax") or scale_rounding is not None or stochastic:
        raise ValueError(f"{name}: algorithm='hqq' starts from min-max ranges and rounds to nearest; it takes no "
                         f"calibration={calibration!r}, scale_rounding={scale_rounding!r} or stochastic rounding")
