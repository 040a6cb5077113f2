"""The numerical oracle: choose_qparams_affine, quantize_affine, dequantize_affine (pure PyTorch).

Every layout's ``dequantize()`` and every kernel is checked against these functions.

Shapes: ``x`` has shape S; ``block_size`` has one entry per dim of S; ``scale`` and ``zero_point`` have
shape ``[ceil(s / b) for s, b in zip(S, block_size)]`` (same rank as ``x``). A block size need not divide
its dim: the last block along that dim is partial (K = 576 in groups of 128: four whole groups and one of
64), and a partial block's qparams come from its real elements only. See Note [Partial blocks].

Formulas (q = code, s = scale, z = zero point, mid = (qmin + qmax + 1) // 2):
  ZeroPointDomain.NONE   x ~ q * s                   (symmetric, signed codes)
  ZeroPointDomain.INT    x ~ (q - z) * s             z is an integer code; 0.0 maps to z exactly
  ZeroPointDomain.FLOAT  x ~ (q - mid) * s + z       z is a float (tinygemm / HQQ style)
  float8                 x ~ float(q) * s            q saturates at the format's max
  nf4 / fp4_e2m1         x ~ levels[q] * s           nearest level, ties towards zero
See Note [Power-of-two scales] for ``scale_rounding="power_of_two"`` (OCP microscaling, MXFP8 / MXFP4) and
Note [Float8 block scales] for ``scale_rounding="float8_e4m3"`` (NVFP4).
All arithmetic is float32; results are cast to the requested dtype at the end. Near the edge of float32's
range (or the weight dtype's), scales are capped so nothing overflows: Note [Finite range].
"""
from __future__ import annotations

import math
from enum import Enum

import torch
import torch.nn.functional as F

from .calibration import Calibration, parse_calibration
from .granularity import validate_block_size
from .qdtype import QDType, QKind

__all__ = ["MappingType", "ZeroPointDomain", "choose_qparams_affine", "quantize_affine",
           "dequantize_affine", "default_zero_point_domain", "code_midpoint", "num_blocks", "padded_shape", "pad_to",
           "finite_limit", "range_over", "cap_scale", "check_finite_values", "split_float8_scales"]


class MappingType(str, Enum):
    """How a block's float range maps onto the code range.

    A ``str`` enum: configs accept a member or its value (``"symmetric"``, ...).

    Attributes:
        SYMMETRIC: codes centred on zero (no zero point for signed codes); the scale covers max|x| over half the
            code range.
        SYMMETRIC_NO_CLIPPING_ERR: symmetric, but the scale makes both qmin and qmax reachable without clipping
            either side (the negative and positive ends each get their own bound).
        ASYMMETRIC: the range [min, max] is spread over all codes, with a zero point.

    Example:
        ```python
        import torchqkit as qk
        config = qk.IntxWeightOnlyConfig(bits=4, mapping=qk.MappingType.ASYMMETRIC)
        assert qk.MappingType("asymmetric") is qk.MappingType.ASYMMETRIC
        ```
    """
    SYMMETRIC = "symmetric"
    # Symmetric, but the scale makes both qmin and qmax reachable without clipping either side.
    SYMMETRIC_NO_CLIPPING_ERR = "symmetric_no_clipping_err"
    ASYMMETRIC = "asymmetric"


class ZeroPointDomain(str, Enum):
    """Where a zero point lives, which fixes the dequantization formula.

    A ``str`` enum: configs and the primitives accept a member or its value (``"none"``, ``"int"``, ``"float"``).
    With q the code, s the scale, z the zero point and mid the middle code:

    Attributes:
        NONE: no zero point: x ~ q * s (symmetric signed codes, float8, codebooks).
        INT: an integer code: x ~ (q - z) * s, and 0.0 maps to z exactly.
        FLOAT: a float: x ~ (q - mid) * s + z (the tinygemm / HQQ / GGUF Q4_1 style).

    Example:
        ```python
        import torchqkit as qk
        config = qk.Int8DynamicActivationIntxWeightConfig(weight_mapping="asymmetric",
                                                          weight_zero_point_domain=qk.ZeroPointDomain.FLOAT)
        ```
    """
    NONE = "none"
    INT = "int"
    FLOAT = "float"


def code_midpoint(qdtype: QDType) -> int:
    return int(qdtype.qmin + qdtype.qmax + 1) // 2


def default_zero_point_domain(qdtype: QDType, mapping: MappingType) -> ZeroPointDomain:
    """Symmetric signed codes need no zero point; unsigned or asymmetric ones get an integer one."""
    if qdtype.kind is not QKind.INT:
        return ZeroPointDomain.NONE
    if mapping is not MappingType.ASYMMETRIC and qdtype.signed:
        return ZeroPointDomain.NONE
    return ZeroPointDomain.INT


# ----------------------------------------------------------------------------------------------
# Block views
# ----------------------------------------------------------------------------------------------

def _check_block_size(x: torch.Tensor, block_size, name: str) -> tuple[int, ...]:
    block_size = tuple(int(b) for b in block_size)
    reason = validate_block_size(x.shape, block_size)
    if reason is not None:
        raise ValueError(f"{name}: can't tile shape {tuple(x.shape)} with block_size {block_size}: {reason}")
    return block_size


# Note [Partial blocks]
# ~~~~~~~~~~~~~~~~~~~~~
# Real models have widths no group size divides (SmolLM2: K = 576, 1536 with groups of 128 or 256). The
# oracle pads such a tensor up to whole blocks (``padded_shape``), computes block-wise, and crops back:
# padded elements take part in no statistic (choose_qparams_affine pads with a copy of the block's own last
# element, which leaves absmax / min / max alone, and hands ``Calibration.block_range`` a validity mask for
# the rms), their codes are cut off by quantize_affine, and dequantize_affine never sees them. Layouts store whole blocks
# (their padding is storage, not meaning) and crop to the logical shape in ``unpack``.

def num_blocks(shape, block_size) -> tuple[int, ...]:
    """Blocks along each dim: ceil(s / b); the shape of scale and zero_point."""
    return tuple(-(-int(s) // int(b)) for s, b in zip(shape, block_size))


def padded_shape(shape, block_size) -> tuple[int, ...]:
    """``shape`` rounded up to whole blocks along every dim."""
    return tuple(n * int(b) for n, b in zip(num_blocks(shape, block_size), block_size))


def pad_to(x: torch.Tensor, shape, value=0) -> torch.Tensor:
    """``x`` padded at the end of each dim with ``value`` up to ``shape`` (``x`` itself if nothing to pad)."""
    pads = []
    for s, t in zip(reversed(x.shape), reversed(tuple(shape))):
        pads += [0, int(t) - s]
    if not any(pads):
        return x
    if x.dtype.is_floating_point or x.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                                                torch.bool):
        return F.pad(x, pads, value=value)
    out = torch.full(tuple(shape), value, dtype=x.dtype, device=x.device)  # float8: F.pad has no kernel
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


def _blocks(x: torch.Tensor, block_size, value=0.0) -> torch.Tensor:
    """View x of shape S as (n0, b0, n1, b1, ...), padded with ``value`` up to whole blocks."""
    x = pad_to(x, padded_shape(x.shape, block_size), value)
    shape = []
    for s, b in zip(x.shape, block_size):
        shape += [s // b, b]
    return x.reshape(shape)


def _pad_with_edge(x: torch.Tensor, block_size) -> torch.Tensor:
    """x padded up to whole blocks with copies of its last element along each dim. That element lies in the
    same (partial) block as the padding, so the block's min, max and absmax stay those of its real values,
    and no mask is needed for them (a full-size mask costs more than the statistics on real-model widths)."""
    for d, (s, b) in enumerate(zip(x.shape, block_size)):
        extra = -s % b
        if extra:
            edge = x.narrow(d, s - 1, 1)
            x = torch.cat([x, edge.expand(*[extra if i == d else n for i, n in enumerate(x.shape)])], dim=d)
    return x


def _valid_blocks(x: torch.Tensor, block_size) -> torch.Tensor | None:
    """Mask of real (not padded) elements in ``_blocks`` form, or None when the blocks tile x exactly."""
    if padded_shape(x.shape, block_size) == tuple(x.shape):
        return None
    return _blocks(torch.ones(x.shape, dtype=torch.bool, device=x.device), block_size, False)


def _crop(x: torch.Tensor, shape) -> torch.Tensor:
    """Undo ``_blocks``' padding: the leading ``shape`` of a padded tensor."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, s) for s in shape)]


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """View a per-block tensor (n0, n1, ...) as (n0, 1, n1, 1, ...) to broadcast against _blocks()."""
    shape = []
    for n in t.shape:
        shape += [n, 1]
    return t.reshape(shape)


def _odd_dims(ndim: int) -> tuple[int, ...]:
    return tuple(range(1, 2 * ndim, 2))


def check_finite_values(x: torch.Tensor, name: str) -> None:
    """Refuse NaN / Inf values, and values past float32's range (float64), with the reason and the way out."""
    if x.is_meta:
        return  # no values to check (shape-only tracing)
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{name} contains {bad} NaN/Inf value(s); quantization would poison whole blocks. "
                         f"Replace them in the float weights first, or leave this module out "
                         f"(ModuleConfigs({{'<module name>': None, ...}}) keeps it in float).")
    limit = torch.finfo(torch.float32).max
    if torch.finfo(x.dtype).max > limit and x.numel() and x.abs().max().item() > limit:
        largest = x.abs().max().item()
        raise ValueError(f"{name} ({x.dtype}) reaches {largest:.4g}, past float32's largest finite value ({limit:.4g}): "
                         f"quantization computes in float32 (Note [Finite range]), so these values would become "
                         f"inf. Scale the weights into float32's range first, or leave this module out "
                         f"(ModuleConfigs({{'<module name>': None, ...}}) keeps it in float).")


# Note [Finite range]
# ~~~~~~~~~~~~~~~~~~~
# The oracle and every kernel compute in float32, and dequantized values are cast to the weight's dtype. A finite
# weight near that range's edge (float32 values of 3e38, float16 ones of 65504) can still give inf: the span
# hi - lo of a block overflows, a symmetric int8 scale of amax / 127.5 puts code -128 half a step past amax, and
# the float zero point's (q - mid) * s overflows before z is added. So a block's range is taken without
# overflow (``range_over``) and its scale is capped (``cap_scale``) so that every code times the scale (and for
# a FLOAT zero point, the zero point as well) stays within ``finite_limit``: a block that reaches the edge
# loses its extreme half step, never becomes inf. Blocks away from the edge keep their arithmetic bit for bit.

def finite_limit(dtype: torch.dtype) -> float:
    """The largest magnitude a dequantized element may take: the smaller of float32's (the arithmetic) and
    ``dtype``'s (what dequantize returns)."""
    limit = torch.finfo(torch.float32).max
    return min(limit, torch.finfo(dtype).max) if dtype.is_floating_point else limit


def range_over(lo: torch.Tensor, hi: torch.Tensor, n: float) -> torch.Tensor:
    """(hi - lo) / n without overflow: hi - lo of two finite float32 values can pass float32's max."""
    span = hi - lo
    return torch.where(torch.isfinite(span), span / n, hi / n - lo / n)


def cap_scale(scale: torch.Tensor, max_code, limit: float, scale_dtype: torch.dtype) -> torch.Tensor:
    """``scale`` capped so that ``max_code`` (the largest |code offset| a block's scale multiplies: a float or a
    tensor shaped like ``scale``) times it stays within ``limit`` once the scale is stored in ``scale_dtype``
    (rounding to it may go up by half an ulp, hence the margin). Uncapped blocks are returned as they were."""
    bound = (limit * (1.0 - torch.finfo(scale_dtype).eps)) / max_code
    return torch.where(scale > bound, bound, scale) if torch.is_tensor(bound) else scale.clamp(max=bound)


# ----------------------------------------------------------------------------------------------
# choose_qparams_affine
# ----------------------------------------------------------------------------------------------

def choose_qparams_affine(
    x: torch.Tensor,
    qdtype: QDType,
    block_size,
    *,
    mapping: MappingType = MappingType.SYMMETRIC,
    zero_point_domain: ZeroPointDomain | None = None,
    calibration: str | Calibration | None = None,
    eps: float | None = None,
    scale_dtype: torch.dtype | None = None,
    zero_point_dtype: torch.dtype | None = None,
    check_finite: bool = True,
    scale_rounding: str | None = None,
    name: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose the scale (and zero point) of every block of ``x``: the first step of the reference quantizer.

    Part of the pure-PyTorch numerical oracle every layout and kernel is checked against. ``x`` is split into
    blocks of ``block_size`` (a block size need not divide its dimension: the last block is partial and its
    qparams come from its real elements only); each block's float range is found by ``calibration`` and turned
    into a scale, and a zero point when ``zero_point_domain`` needs one. A block whose range is zero gets scale 1
    (never inf or NaN); other scales are floored at ``eps``; scales are capped so that nothing overflows.

    Args:
        x (torch.Tensor): the float tensor to quantize.
        qdtype (QDType): the code format (``qk.qdtypes.int8``, ``qk.qdtypes.uint4``, ``qk.qdtypes.nf4``, ...).
        block_size (tuple[int, ...]): elements per block along each dimension of ``x`` (one entry per dimension),
            e.g. from a granularity: ``qk.PerGroup(32).block_size(x.shape)``.
        mapping (MappingType): ``SYMMETRIC`` (default), ``SYMMETRIC_NO_CLIPPING_ERR`` or ``ASYMMETRIC`` (integer
            qdtypes only), or its value.
        zero_point_domain (ZeroPointDomain | None): None (default): none for symmetric signed codes and non-integer
            qdtypes, ``INT`` otherwise; or ``NONE`` / ``INT`` / ``FLOAT`` (or its value).
        calibration (str | None): how a block's range is found: ``"absmax"``, ``"minmax"``, ``"rms,<k>"`` or
            ``"fixed,<lo>,<hi>"``, each with an optional trailing clipping factor in (0, 1] (``"absmax,0.9"``).
            None (default): ``"minmax"`` for asymmetric mappings, ``"absmax"`` otherwise.
        eps (float | None): the smallest scale; None (default): the smallest normal number of ``scale_dtype``.
            Not allowed with power-of-two scales.
        scale_dtype (torch.dtype | None): dtype of the returned scale; None (default): ``x``'s dtype when it is a
            float dtype, else float32.
        zero_point_dtype (torch.dtype | None): dtype of the zero point; None (default): ``qdtype.storage_dtype``
            for ``INT`` zero points, ``scale_dtype`` for ``FLOAT`` ones.
        check_finite (bool): refuse NaN / Inf in ``x``, and scales or zero points that ``scale_dtype`` can't hold;
            default True.
        scale_rounding (str | None): None (default); ``"power_of_two"``: E8M0 scales as the OCP MX spec chooses
            them; or ``"float8_e4m3"``: float8 e4m3 block scales under one power-of-two scale per tensor (NVFP4,
            Note [Float8 block scales]). Both for float8 and codebook qdtypes only, with a ``scale_dtype`` that
            holds 2^127 (float32).
        name (str): what ``x`` is, for error messages; default ``"tensor"``.

    Returns:
        tuple[torch.Tensor, torch.Tensor | None]: ``(scale, zero_point)``, each of shape
            ``[ceil(s / b) for s, b in zip(x.shape, block_size)]``; ``zero_point`` is None for ``ZeroPointDomain.NONE``.

    Raises:
        ValueError: a ``block_size`` that can't tile ``x``, a mapping / zero-point domain the qdtype can't take, an
            unknown calibration or scale rounding, NaN / Inf values (with ``check_finite``), or scales that would
            overflow ``scale_dtype``.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = torch.randn(64, 256)
        block = qk.PerGroup(32).block_size(w.shape)            # (1, 32)
        scale, zero = qk.choose_qparams_affine(w, qk.qdtypes.uint4, block, mapping="asymmetric")
        codes = qk.quantize_affine(w, qk.qdtypes.uint4, block, scale, zero)
        w_hat = qk.dequantize_affine(codes, qk.qdtypes.uint4, block, scale, zero)
        ```
    """
    mapping = mapping if isinstance(mapping, MappingType) else MappingType(mapping)
    block_size = _check_block_size(x, block_size, name)
    if calibration is None:  # asymmetric schemes exist to use both ends of the range
        calibration = "minmax" if mapping is MappingType.ASYMMETRIC else "absmax"
    calib = parse_calibration(calibration)
    if zero_point_domain is None:
        zero_point_domain = default_zero_point_domain(qdtype, mapping)
    if not isinstance(zero_point_domain, ZeroPointDomain):  # torch 2.11's dynamo can't trace Enum(member): no call
        zero_point_domain = ZeroPointDomain(zero_point_domain)
    _check_scheme(qdtype, mapping, zero_point_domain, name)
    if check_finite:
        check_finite_values(x, name)
    scale_dtype = scale_dtype or (x.dtype if x.dtype.is_floating_point else torch.float32)
    _check_scale_rounding(scale_rounding, qdtype, eps, scale_dtype, name)
    if eps is None:
        eps = torch.finfo(scale_dtype).tiny

    # Edge padding keeps absmax / min / max exact; a mean (rms) also needs to know which elements are real.
    valid = _valid_blocks(x, block_size) if calib.method == "rms" else None
    lo, hi = calib.block_range(_blocks(_pad_with_edge(x, block_size), block_size), _odd_dims(x.ndim), valid)
    lo, hi = lo.reshape(lo.shape[0::2]), hi.reshape(hi.shape[0::2])  # drop the size-1 block dims

    zero_point = None
    limit = finite_limit(x.dtype)  # Note [Finite range]
    if qdtype.kind is QKind.INT:
        scale, zero_point = _int_qparams(lo, hi, qdtype, mapping, zero_point_domain, eps, limit, scale_dtype)
    elif qdtype.kind is QKind.FLOAT:
        scale = torch.ones_like(hi)  # the values are their own codes: Note [Float identity codes] (core/qdtype.py)
    elif scale_rounding == POWER_OF_TWO:
        scale = _power_of_two_scale(torch.maximum(-lo, hi), qdtype)  # codes * 2^e stay below 2^128: no cap
    elif scale_rounding == FLOAT8_E4M3:
        scale = _float8_block_scale(torch.maximum(-lo, hi), qdtype, limit)
    else:
        amax = torch.maximum(-lo, hi)
        scale = _floor_scale(amax / qdtype.max_abs_level, amax, eps)
        scale = cap_scale(scale, qdtype.max_abs_level, limit, scale_dtype)
    scale = _cast_in_range(scale, scale_dtype, check_finite, f"{name}'s scales")
    if zero_point is not None:
        if zero_point_domain is ZeroPointDomain.INT:
            zero_point = zero_point.to(zero_point_dtype or qdtype.storage_dtype)
        else:
            zero_point = _cast_in_range(zero_point, zero_point_dtype or scale_dtype, check_finite,
                                        f"{name}'s zero points")
    return scale, zero_point


def _cast_in_range(t: torch.Tensor, dtype: torch.dtype, check: bool, what: str) -> torch.Tensor:
    """t.to(dtype), refusing values that dtype can't hold: a float16 scale past 65504 would become inf and
    dequantize the whole block to inf / NaN."""
    out = t.to(dtype)
    if check and out.dtype != t.dtype and not t.is_meta and dtype.is_floating_point and \
            (torch.isfinite(t) & ~torch.isfinite(out)).any():  # no cast (the common case): nothing to check
        largest = t[torch.isfinite(t)].abs().max().item()
        raise ValueError(f"{what} reach {largest:.4g}, past the largest {dtype} ({torch.finfo(dtype).max:.4g}): they "
                         f"would be stored as inf. Use a wider scale_dtype (torch.float32 or torch.bfloat16).")
    return out


# Note [Power-of-two scales]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# OCP Microscaling Formats (MX) spec v1.0, section 6.3: a block's shared scale is X = 2^e with
#   e = floor(log2(amax)) - emax_elem,   emax_elem = exponent of the element format's largest normal
# (e4m3: 448 = 1.75 * 2^8 -> 8; e5m2: 57344 -> 15; e2m1: 6 = 1.5 * 2^2 -> 2), so emax_elem is
# floor(log2(max_abs_level)). amax / X lies in [2^emax_elem, 2^(emax_elem+1)), which can exceed the
# format's max (e.g. 7.5 for e2m1): quantize_affine saturates those elements to +-max, as the spec says.
# e is clamped to E8M0's range [-127, 127]; an all-zero block gets X = 1. ``eps`` does not apply.
POWER_OF_TWO = "power_of_two"
FLOAT8_E4M3 = "float8_e4m3"
SCALE_ROUNDINGS = (None, POWER_OF_TWO, FLOAT8_E4M3)


def _check_scale_rounding(scale_rounding, qdtype: QDType, eps, scale_dtype, name: str) -> None:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"{name}: scale_rounding must be one of {SCALE_ROUNDINGS}, got {scale_rounding!r}")
    if scale_rounding is None:
        return
    if qdtype.kind in (QKind.INT, QKind.FLOAT):
        raise ValueError(f"{name}: {scale_rounding} scales are defined for float8 and codebook (fp4 / fp6 / nf4) "
                         f"elements (OCP MX, NVFP4), not {qdtype.name}")
    if eps is not None:
        raise ValueError(f"{name}: eps does not apply to {scale_rounding} scales (their format bounds them); "
                         f"drop eps=")
    if torch.finfo(scale_dtype).max < 2.0 ** 127:
        raise ValueError(f"{name}: {scale_rounding} scales span 2^-127..2^127, which {scale_dtype} can't hold; "
                         f"use scale_dtype=torch.float32")
    if scale_rounding == FLOAT8_E4M3 and scale_dtype != torch.float32:
        raise ValueError(f"{name}: float8_e4m3 block scales are float32 quotients E / G (Note [Float8 block scales], "
                         f"as NVFP4 checkpoints compute them), not {scale_dtype}; use scale_dtype=torch.float32")


def _power_of_two_scale(amax: torch.Tensor, qdtype: QDType) -> torch.Tensor:
    emax_elem = math.floor(math.log2(qdtype.max_abs_level))
    # frexp gives amax = m * 2^p with m in [0.5, 1): floor(log2(amax)) = p - 1, exactly (no log2 rounding).
    _, p = torch.frexp(amax)
    e = (p - 1 - emax_elem).clamp(-127, 127)
    scale = torch.ldexp(torch.ones_like(amax), e)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


# Note [Float8 block scales]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# NVFP4 (NVIDIA ModelOpt, compressed-tensors' nvfp4-pack-quantized): a block's scale is S = E / G, with E a float8
# e4m3fn value (one per block of 16) and G one float32 "global scale" per tensor, chosen so that the block
# scales amax_block / max_level fill e4m3's range. compressed-tensors takes G = 448 * 6 / amax_tensor; the oracle
# takes G = 2^q, the largest power of two with (amax_tensor / max_level) * G <= 448, so the largest block's E lies
# in (224, 448] (the same e4m3 range, half an exponent less at most). A power of two makes S = E * 2^-q exact in
# float32, the codes' products level * E * 2^-q exact too (at most 2 + 4 significant bits: exact even in bf16), and
# lets ``split_float8_scales`` recover (E, G) from the block scales alone, which a layout must (it stores E and
# G, it is handed S). E = e4m3(amax_block / max_level * G), rounded to nearest; elements whose block scale
# rounded down saturate at +-max_level, as the format does. E is at least e4m3's smallest subnormal (2^-9), also
# for all-zero blocks, so no scale is 0. q is kept in [-119, 127] (S = E * 2^-q exact in float32).
_E4M3_MAX = 448.0
_E4M3_TINY = 2.0 ** -9
_Q_RANGE = (-119, 127)


def _pow2_exponent_below(top: torch.Tensor, limit: float) -> torch.Tensor:
    """The largest integer q with top * 2^q <= limit (top > 0, float32 0-d), computed exactly."""
    _, p = torch.frexp(limit / top)                  # limit / top in [2^(p-1), 2^p), up to its rounding
    q = p - 1
    q = torch.where(torch.ldexp(top, q) > limit, q - 1, q)
    return torch.where(torch.ldexp(top, q + 1) <= limit, q + 1, q).clamp(*_Q_RANGE)


def _float8_block_scale(amax: torch.Tensor, qdtype: QDType, limit: float) -> torch.Tensor:
    raw = amax / qdtype.max_abs_level
    top = raw.max() if raw.numel() else raw.new_ones(())
    q = _pow2_exponent_below(torch.where(top > 0, top, torch.ones_like(top)), _E4M3_MAX)
    codes = torch.ldexp(raw, q).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    # Note [Finite range]: a block whose E rounded up past what max_level * E * 2^-q can reach in float32 (or the
    # weight's dtype) takes the next e4m3 value down (one code less: positive e4m3 codes are ordered by value).
    over = torch.ldexp(codes.view(torch.float8_e4m3fn).float(), -q) * qdtype.max_abs_level > limit
    codes = torch.where(over, codes - 1, codes)
    e = codes.view(torch.float8_e4m3fn).float().clamp(min=_E4M3_TINY)
    return torch.ldexp(e, -q)


def split_float8_scales(scale: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 block scales (``scale_rounding="float8_e4m3"``) -> (E float8_e4m3fn, G float32 (1,)) with
    ``E.float() / G == scale`` exactly: see Note [Float8 block scales].

    Raises:
        ValueError: scales that are not float8 e4m3 values under one power-of-two global scale.
    """
    s = scale.float()
    if s.is_meta:
        return s.to(torch.float8_e4m3fn), s.new_ones(1)
    top = s.max() if s.numel() else s.new_ones(())
    if not bool(top > 0) or not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"{name}: NVFP4 block scales must be finite and > 0, got a largest of {float(top):.4g}")
    q = _pow2_exponent_below(top, _E4M3_MAX)
    e = torch.ldexp(s, q)
    codes = e.to(torch.float8_e4m3fn)
    if not torch.equal(codes.float(), e) or bool((e < _E4M3_TINY).any()):
        bad = s[codes.float() != e].flatten()[:4].tolist()
        raise ValueError(f"{name}: these block scales are not float8 e4m3 values times one power-of-two global scale "
                         f"(e.g. {bad}); quantize with scale_rounding='float8_e4m3' (NVFP4 configs do).")
    return codes, torch.ldexp(torch.ones(1, device=s.device), q.reshape(1))


def _check_scheme(qdtype: QDType, mapping: MappingType, zpd: ZeroPointDomain, name: str) -> None:
    if qdtype.kind is not QKind.INT:
        if mapping is MappingType.ASYMMETRIC or zpd is not ZeroPointDomain.NONE:
            raise ValueError(f"{name}: {qdtype.name} is symmetric by construction; use MappingType.SYMMETRIC "
                             f"and no zero point")
        return
    if zpd is ZeroPointDomain.NONE and (mapping is MappingType.ASYMMETRIC or not qdtype.signed):
        raise ValueError(f"{name}: {qdtype.name} with {mapping.value} mapping needs a zero point "
                         f"(ZeroPointDomain.INT or FLOAT)")


def _floor_scale(scale: torch.Tensor, span: torch.Tensor, eps: float) -> torch.Tensor:
    # Zero-range block -> scale 1 (any scale reproduces it exactly; 1 can't overflow).
    return torch.where(span > 0, scale.clamp(min=eps), torch.ones_like(scale))


def _int_qparams(lo, hi, qdtype, mapping, zpd, eps, limit, scale_dtype):
    qmin, qmax = float(qdtype.qmin), float(qdtype.qmax)
    mid = code_midpoint(qdtype) if not qdtype.signed else 0
    if mapping is MappingType.ASYMMETRIC:
        if zpd is ZeroPointDomain.INT:
            # Keep 0.0 inside the range so it maps to an integer code exactly.
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = _floor_scale(range_over(lo, hi, qmax - qmin), hi - lo, eps)
        if zpd is ZeroPointDomain.INT:
            zero_point = (qmin - torch.round(lo / scale)).clamp(qmin, qmax)
            # codes run from qmin - zp to qmax - zp; zp stays, so 0.0 keeps its exact code
            scale = cap_scale(scale, torch.maximum(zero_point - qmin, qmax - zero_point), limit, scale_dtype)
        else:
            zero_point, scale = _float_zero_point(lo, hi, qdtype, scale, limit, scale_dtype)
        return scale, zero_point
    # Symmetric: codes centred on `mid` (0 for signed codes, the midpoint for unsigned ones).
    amax = torch.maximum(-lo, hi).clamp(min=0)
    if mapping is MappingType.SYMMETRIC:
        scale = amax / ((qmax - qmin) / 2)
    else:  # SYMMETRIC_NO_CLIPPING_ERR: both ends reachable
        neg, pos = (-lo).clamp(min=0) / (mid - qmin), hi.clamp(min=0) / (qmax - mid)
        scale = torch.maximum(neg, pos)
    scale = cap_scale(_floor_scale(scale, amax, eps), max(mid - qmin, qmax - mid), limit, scale_dtype)
    if zpd is ZeroPointDomain.NONE:
        return scale, None
    if zpd is ZeroPointDomain.INT:
        return scale, torch.full_like(scale, float(mid))
    return scale, torch.zeros_like(scale)  # FLOAT domain: x = (q - mid) * s + 0


def _float_zero_point(lo, hi, qdtype, scale, limit, scale_dtype):
    """(zero_point, scale) of a FLOAT-domain block range [lo, hi]: x ~ (q - mid) * s + z with qmin mapping to lo.
    A scale capped by Note [Finite range] covers less than [lo, hi]; such a block's zero point centres the codes
    on the range instead, so both ends lose the same, and (q - mid) * s and z both stay finite."""
    qmin, qmax, mid = float(qdtype.qmin), float(qdtype.qmax), code_midpoint(qdtype)
    capped = cap_scale(scale, max(mid - qmin, qmax - mid), limit, scale_dtype)
    zero_point = lo - (qmin - mid) * scale
    centred = lo / 2 + hi / 2 - ((qmin + qmax) / 2 - mid) * capped
    return torch.where(capped < scale, centred, zero_point), capped


# ----------------------------------------------------------------------------------------------
# quantize_affine / dequantize_affine
# ----------------------------------------------------------------------------------------------

def quantize_affine(
    x: torch.Tensor,
    qdtype: QDType,
    block_size,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    *,
    zero_point_domain: ZeroPointDomain | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    check_finite: bool = True,
    name: str = "tensor",
) -> torch.Tensor:
    """Turn ``x`` into codes with given block scales (and zero points): the second step of the reference quantizer.

    Integer codes are rounded (half to even, or stochastically) and clamped to the qdtype's range; float8 codes
    saturate at the format's largest value; codebook codes (nf4, fp4_e2m1) are the nearest level's index, ties
    towards zero. Blocks may be partial, as in ``choose_qparams_affine``.

    Args:
        x (torch.Tensor): the float tensor to quantize.
        qdtype (QDType): the code format.
        block_size (tuple[int, ...]): elements per block along each dimension of ``x``.
        scale (torch.Tensor): one scale per block (as ``choose_qparams_affine`` returns).
        zero_point (torch.Tensor | None): one zero point per block, or None (default) for no zero point.
        zero_point_domain (ZeroPointDomain | None): None (default): ``NONE`` without a zero point, else ``INT`` for
            an integer-dtype zero point of an integer qdtype and ``FLOAT`` otherwise; or a member / its value.
        stochastic (bool): stochastic rounding for integer codes; default False. Needs ``generator``.
        generator (torch.Generator | None): the seeded generator stochastic rounding draws from; default None.
        check_finite (bool): refuse NaN / Inf in ``x``; default True.
        name (str): what ``x`` is, for error messages; default ``"tensor"``.

    Returns:
        torch.Tensor: the codes, same shape as ``x``, in ``qdtype.storage_dtype``.

    Raises:
        ValueError: a ``block_size`` that can't tile ``x``, a zero-point domain that doesn't match ``zero_point``,
            NaN / Inf values (with ``check_finite``), or ``stochastic=True`` without a ``generator``.

    Example:
        ```python
        import torch
        import torchqkit as qk
        x = torch.randn(8, 64)
        block = qk.PerRow().block_size(x.shape)
        scale, _ = qk.choose_qparams_affine(x, qk.qdtypes.int8, block)
        codes = qk.quantize_affine(x, qk.qdtypes.int8, block, scale)      # torch.int8, shape (8, 64)
        ```
    """
    block_size = _check_block_size(x, block_size, name)
    zpd = _resolve_zpd(qdtype, zero_point, zero_point_domain, name)
    if check_finite:
        check_finite_values(x, name)
    xb = _blocks(x.float(), block_size)
    s = _per_block(scale.float())
    padded = padded_shape(x.shape, block_size)
    if qdtype.kind is QKind.FLOAT8:
        fmax = float(qdtype.qmax)
        return _crop((xb / s).clamp(-fmax, fmax).to(qdtype.storage_dtype).reshape(padded), x.shape)
    if qdtype.kind is QKind.CODEBOOK:
        return _crop(_nearest_level(xb / s, qdtype).reshape(padded), x.shape)
    if qdtype.kind is QKind.FLOAT:  # a cast (exact for values already in that dtype): Note [Float identity codes]
        return _crop((xb / s).to(qdtype.storage_dtype).reshape(padded), x.shape)
    if stochastic and generator is None:
        raise ValueError(f"{name}: stochastic rounding needs a seeded torch.Generator (generator=...)")
    if zpd is ZeroPointDomain.FLOAT:
        v = (xb - _per_block(zero_point.float())) / s + code_midpoint(qdtype)
    else:
        v = xb / s
        if zpd is ZeroPointDomain.INT:
            v = v + _per_block(zero_point.float())
    v = _round(v, stochastic, generator)
    return _crop(v.clamp(qdtype.qmin, qdtype.qmax).to(qdtype.storage_dtype).reshape(padded), x.shape)


def dequantize_affine(
    codes: torch.Tensor,
    qdtype: QDType,
    block_size,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    *,
    zero_point_domain: ZeroPointDomain | None = None,
    output_dtype: torch.dtype = torch.float32,
    name: str = "tensor",
) -> torch.Tensor:
    """The float values of ``codes`` given their block scales (and zero points): the reference dequantizer.

    Computes q * s, (q - z) * s or (q - mid) * s + z per ``zero_point_domain`` (codebook codes are first mapped to
    their levels), in float32, then casts to ``output_dtype``.

    Args:
        codes (torch.Tensor): codes as ``quantize_affine`` returns them (unpacked, one per element).
        qdtype (QDType): the code format.
        block_size (tuple[int, ...]): elements per block along each dimension of ``codes``.
        scale (torch.Tensor): one scale per block.
        zero_point (torch.Tensor | None): one zero point per block, or None (default).
        zero_point_domain (ZeroPointDomain | None): None (default): inferred from ``zero_point`` as in
            ``quantize_affine``; or a member / its value.
        output_dtype (torch.dtype): dtype of the result; default ``torch.float32``.
        name (str): what the codes are, for error messages; default ``"tensor"``.

    Returns:
        torch.Tensor: the dequantized values, same shape as ``codes``, in ``output_dtype``.

    Raises:
        ValueError: a ``block_size`` that can't tile ``codes``, or a zero-point domain that doesn't match
            ``zero_point``.

    Example:
        ```python
        import torch
        import torchqkit as qk
        x = torch.randn(8, 64)
        block = qk.PerRow().block_size(x.shape)
        scale, _ = qk.choose_qparams_affine(x, qk.qdtypes.int8, block)
        codes = qk.quantize_affine(x, qk.qdtypes.int8, block, scale)
        x_hat = qk.dequantize_affine(codes, qk.qdtypes.int8, block, scale, output_dtype=torch.bfloat16)
        ```
    """
    block_size = _check_block_size(codes, block_size, name)
    zpd = _resolve_zpd(qdtype, zero_point, zero_point_domain, name)
    s = _per_block(scale.float())
    if qdtype.kind is QKind.CODEBOOK:
        levels = torch.tensor(qdtype.levels, dtype=torch.float32, device=codes.device)
        vals = levels[codes.long()]
    else:
        vals = codes.float()
    vals = _blocks(vals, block_size)
    if zpd is ZeroPointDomain.INT:
        out = (vals - _per_block(zero_point.float())) * s
    elif zpd is ZeroPointDomain.FLOAT:
        out = (vals - code_midpoint(qdtype)) * s + _per_block(zero_point.float())
    else:
        out = vals * s
    return _crop(out.reshape(padded_shape(codes.shape, block_size)), codes.shape).to(output_dtype)


def _resolve_zpd(qdtype, zero_point, zero_point_domain, name) -> ZeroPointDomain:
    if zero_point_domain is None:
        zero_point_domain = ZeroPointDomain.NONE if zero_point is None else (
            ZeroPointDomain.INT if qdtype.kind is QKind.INT and not zero_point.dtype.is_floating_point
            else ZeroPointDomain.FLOAT)
    zpd = zero_point_domain if isinstance(zero_point_domain, ZeroPointDomain) else ZeroPointDomain(zero_point_domain)
    if (zpd is ZeroPointDomain.NONE) != (zero_point is None):
        raise ValueError(f"{name}: zero_point_domain={zpd.value} but zero_point is "
                         f"{'missing' if zero_point is None else 'given'}")
    return zpd


def _round(v: torch.Tensor, stochastic: bool, generator) -> torch.Tensor:
    if not stochastic:
        return torch.round(v)  # round half to even
    noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
    return torch.floor(v + noise)


def _nearest_level(v: torch.Tensor, qdtype: QDType) -> torch.Tensor:
    """Code of the nearest codebook level; a value exactly between two levels goes to the one nearer zero."""
    # The table is a constant: sorted in Python (no data-dependent shapes for torch.compile, none on the meta device).
    # Equal levels (fp4's and fp6's +0 and -0) keep one code each: +0's.
    by_value: dict[float, int] = {}
    for code, level in enumerate(qdtype.levels):
        if level not in by_value or (level == 0 and math.copysign(1.0, qdtype.levels[by_value[level]]) < 0):
            by_value[level] = code
    values = sorted(by_value)
    uniq = torch.tensor(values, dtype=torch.float32, device=v.device)
    codes = torch.tensor([by_value[x] for x in values], dtype=torch.int64, device=v.device)
    lo, hi = values[0], values[-1]
    mids = (uniq[1:] + uniq[:-1]) / 2
    v = v.clamp(lo, hi)
    # bucketize (right=False) puts a tie on the lower level: nearer zero for v > 0; a negative tie moves one level
    # up (what right=True gives), found by comparing with the midpoint (one search, not one per side: it is most of
    # the cost of quantizing to a codebook)
    idx = torch.bucketize(v, mids, right=False)
    idx = idx + ((v < 0) & (mids[idx.clamp(max=mids.numel() - 1)] == v))
    return codes[idx].to(qdtype.storage_dtype)
