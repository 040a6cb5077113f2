"""Activation quantization: a field of the weight tensor that its linear reads (never a second
subclass wrapped around the first)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.activation_quant import (activation_block_size, activation_group_size, activation_per_tensor,
                                     activation_scale_rounding, dequantize_activation, quantize_activation)
from ..core.granularity import Granularity, PerGroup, PerRow, PerTensor, PerToken
from ..core.primitives import MappingType
from ..core.qdtype import QDType, QKind, fp4_e2m1, int4
from ..layouts.mx import MX_BLOCK
from ..kernels.preference import KernelPreference

__all__ = ["ActivationQuantSpec", "KernelPreference", "QuantizedActivation"]

NVFP4_ACT_GROUP = 16  # NVFP4 activations: one float8 scale per token and 16 features


@dataclass(frozen=True)
class QuantizedActivation:
    qdata: torch.Tensor          # (M, K) codes
    scale: torch.Tensor          # (M, 1), (1, 1) or per group (M, K / group_size), float32
    zero_point: torch.Tensor | None  # (M, 1) int8 codes for asymmetric int8, else None


# Note [Non-finite activation rows]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# F.linear(x, W) gives a non-finite output row exactly where the input row has a NaN / Inf, and leaves the other
# rows alone. Quantizing activations breaks both halves unless told not to: a per-tensor dynamic scale takes the
# amax over every row, so one Inf row zeroes all the others; clamping to the code range turns Inf into the
# largest code, and the quantizer gives a NaN row an empty range (scale 1, codes 0), i.e. a finite row. So a
# dynamic per-tensor scale is computed from the finite values only, and a row with any NaN / Inf is carried as
# NaN codes (float8) or a NaN scale (int8, whose scales are per token): its outputs are NaN, the others exact.


@dataclass(frozen=True)
class ActivationQuantSpec:
    """How a quantized linear quantizes its input before the matmul.

    Stored on the weight (``AffineQuantizedTensor.act_quant``) by the activation-quantizing configs; the linear
    reads it on every call. Rows with NaN / Inf stay non-finite in the output without touching other rows.
    ``quantize(x2d)`` / ``dequantize(qa, dtype)`` / ``fake_quantize(x2d)`` apply it to a (M, K) activation.

    Accepted combinations:

    - int8: ``PerToken()`` (or ``PerRow()``), symmetric or asymmetric dynamic scales; ``PerGroup(n)``, symmetric
      dynamic scales per token and group of n features (llama.cpp's Q8_1); or ``PerTensor()`` symmetric with a
      given ``static_scale``.
    - int4: ``PerToken()`` (or ``PerRow()``), symmetric or asymmetric, or ``PerGroup(n)`` symmetric; dynamic only
      (4-bit activations keep their quality after a rotation: ``rotate_``).
    - float8: ``PerTensor()`` or ``PerRow()`` / ``PerToken()`` (per token), symmetric, dynamic or with a given
      ``static_scale``; or ``PerGroup(32)``, dynamic: MXFP8, one power-of-two (E8M0) scale per token and 32
      features, chosen as the OCP MX spec says (the oracle's ``scale_rounding="power_of_two"``).
    - fp4_e2m1 (NVFP4): ``PerGroup(16)``, dynamic: float8 e4m3 scales per token and group of 16 features under one
      power-of-two scale per call (the oracle's ``scale_rounding="float8_e4m3"``).

    Args:
        qdtype (QDType): ``qk.qdtypes.int8``, ``int4``, ``float8_e4m3fn``, ``float8_e5m2``, ``float8_e4m3fnuz``,
            ``float8_e5m2fnuz`` (not per group: MXFP8 elements are OCP float8) or ``fp4_e2m1``.
        granularity (Granularity): the scale granularity; default ``PerToken()``.
        mapping (MappingType): ``MappingType.SYMMETRIC`` (default) or ``ASYMMETRIC`` (int8 / int4 per token only), or
            its value.
        static_scale (float | None): a fixed scale, a finite number > 0; None (default): dynamic scales computed
            from each input.

    Raises:
        ValueError: a qdtype other than int8 / int4 / float8 / fp4_e2m1, or a granularity, mapping or static scale
            outside the combinations above.

    Example:
        ```python
        import torch
        import torchqkit as qk
        act = qk.ActivationQuantSpec(qk.qdtypes.int8, qk.PerToken(), "asymmetric")
        x_fq = act.fake_quantize(torch.randn(4, 64))        # what the integer matmul sees
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout(), act_quant=act)
        ```
    """
    qdtype: QDType
    granularity: Granularity = PerToken()
    mapping: MappingType = MappingType.SYMMETRIC
    static_scale: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "mapping", MappingType(self.mapping))
        if self.qdtype.kind is QKind.INT:
            if self.qdtype.name not in ("int8", "int4"):
                raise ValueError(f"integer activation quantization supports int8 or int4, got {self.qdtype.name}")
            if self.qdtype == int4 and self.static_scale is not None:
                raise ValueError("int4 activations are quantized with dynamic scales (no static_scale)")
            if self.static_scale is None and not isinstance(self.granularity, (PerToken, PerRow, PerGroup)):
                raise ValueError(f"dynamic {self.qdtype.name} activation quantization is per token: use PerToken() (or "
                                 f"PerGroup(n) "
                                 "for a scale per token and group of n features)")
            if isinstance(self.granularity, PerGroup) and self.mapping is not MappingType.SYMMETRIC:
                raise ValueError(f"{self.qdtype.name} activations per group (PerGroup) are quantized symmetrically: use "
                                 "MappingType.SYMMETRIC")
            if self.static_scale is not None and (not isinstance(self.granularity, PerTensor)
                                                  or self.mapping is not MappingType.SYMMETRIC):
                raise ValueError("a static int8 activation scale is one symmetric per-tensor scale: use PerTensor() "
                                 "and MappingType.SYMMETRIC")
            _check_static_scale(self.static_scale)
        elif self.qdtype.kind is QKind.FLOAT8:
            if isinstance(self.granularity, PerGroup):
                if self.granularity.group_size != MX_BLOCK or self.static_scale is not None:
                    raise ValueError(f"float8 activations per group are MXFP8: PerGroup({MX_BLOCK}), dynamic (no "
                                     f"static_scale)")
                if self.qdtype.is_fnuz:
                    raise ValueError(f"float8 activations per group are MXFP8, whose elements are OCP float8_e4m3fn / "
                                     f"float8_e5m2, not {self.qdtype.name}; use one of those, or {self.qdtype.name} "
                                     f"per token (PerToken()) or per tensor")
            elif not isinstance(self.granularity, (PerTensor, PerRow, PerToken)):
                raise ValueError(f"float8 activation quantization is PerTensor, PerRow or PerGroup({MX_BLOCK}) (MXFP8)")
            if self.mapping is not MappingType.SYMMETRIC:
                raise ValueError("float8 activations are quantized symmetrically")
            _check_static_scale(self.static_scale)
        elif self.qdtype is fp4_e2m1:
            if (not isinstance(self.granularity, PerGroup) or self.granularity.group_size != NVFP4_ACT_GROUP
                    or self.mapping is not MappingType.SYMMETRIC or self.static_scale is not None):
                raise ValueError(f"fp4_e2m1 activations are NVFP4: PerGroup({NVFP4_ACT_GROUP}), symmetric, dynamic "
                                 f"(no static_scale)")
        else:
            raise ValueError(f"activation quantization supports int8, int4, float8 or fp4_e2m1, got {self.qdtype.name}")

    @property
    def group_size(self) -> int | None:
        """Features per scale within a token (PerGroup), or None: one scale per token or per tensor."""
        return activation_group_size(self.granularity)

    @property
    def scale_rounding(self) -> str | None:
        """The oracle's scale rounding: E8M0 for MXFP8 (float8 per 32), float8 for NVFP4, None otherwise."""
        return activation_scale_rounding(self.qdtype, self.granularity)

    @property
    def per_tensor(self) -> bool:
        return activation_per_tensor(self.granularity, self.static_scale)

    def quantize(self, x2d: torch.Tensor) -> QuantizedActivation:
        """Quantize a (M, K) activation. Non-finite rows stay non-finite and touch no other row (see
        Note [Non-finite activation rows]); no error for them: that would force a device sync per call."""
        return QuantizedActivation(*quantize_activation(x2d, self.qdtype, self.granularity, self.mapping,
                                                        self.static_scale))

    def block_size(self, x2d: torch.Tensor) -> tuple[int, int]:
        """The oracle's block size for a (M, K) activation: the whole tensor, one row per token (a static int8
        scale is carried per row too, see ``quantize``), or a group of one token's features."""
        return activation_block_size(x2d.shape, self.qdtype, self.granularity, self.static_scale)

    def dequantize(self, qa: QuantizedActivation, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_activation(qa.qdata, self.qdtype, self.granularity, self.static_scale, qa.scale,
                                     qa.zero_point, dtype)

    def fake_quantize(self, x2d: torch.Tensor) -> torch.Tensor:
        """Quantize then dequantize: what the integer / float8 matmul sees, in float."""
        return self.dequantize(self.quantize(x2d), x2d.dtype)

    def __str__(self) -> str:
        g = type(self.granularity).__name__
        s = f"{self.qdtype.name} {g} {self.mapping.value}"
        return s + (f" static_scale={self.static_scale:g}" if self.static_scale is not None else " dynamic")


def static_scale_problem(static_scale) -> str | None:
    """Why a static activation scale (a divisor) can't be right, or None: it must be a finite number > 0."""
    if static_scale is not None and not (type(static_scale) in (int, float) and math.isfinite(static_scale)
                                         and static_scale > 0):
        return f"static_scale is {static_scale!r:.40}: it must be a finite positive float"
    return None


def _check_static_scale(static_scale) -> None:
    problem = static_scale_problem(static_scale)
    if problem is not None:
        raise ValueError(problem)
