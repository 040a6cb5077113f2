"""PackedIntxLayout: 1..7-bit integer codes packed densely along in_features, and ternary weights at 2 bits.

Tensors (Kp = K rounded up to whole groups, see Note [Partial blocks] in core/primitives.py; the padded
codes are 0 and never read back):
  qdata:      uint8 (N, ceil(Kp * bits / 8)); ternary: uint8 (N, 2 * ceil(Kp / 8))
  scale:      (ceil(N / block_size[0]), ceil(K / block_size[1])), the scale dtype chosen at quantization
  zero_point: same shape as scale, or None (ZeroPointDomain.NONE); stored as the oracle returns it
See Note [Packed intx bits] and Note [Ternary bit planes] for the byte formats. Each row starts on a
byte boundary, so slicing out_features is a row view; slices along in_features cut at whole bytes.

Linear (routes below): weight-only, not ternary: ``torchqkit::linear_intxwo`` on these bytes (C++ CPU kernels);
ternary planes weight-only: ``torchqkit::linear_ternarywo`` (table lookups, no multiplies by weights);
int8 or int4 dynamic activations x int4: ``torchqkit::linear_int8da_int4_packed``; any other activation quantization:
the weight-only op on the fake-quantized input (Note [Activations fake-quantized before a weight-only kernel] in
routes.py). ``torchqkit.kernels.status()`` reports which.

Note [Packed intx bits]
~~~~~~~~~~~~~~~~~~~~~~~
Code q of a b-bit qdtype (b = 1..7, signed or unsigned) is stored as the unsigned field u = q - qmin
(offset binary: int3's -4..3 become 0..7, uint3's 0..7 stay). The fields of one row form a little-endian
bit stream: code k occupies stream bits [k b, (k + 1) b), and stream bit s is bit (s % 8) of byte s // 8
(least significant first). So every 8 codes fill exactly b bytes, with no wasted bits; a row whose K * b
is not a multiple of 8 ends with zero bits in its last byte. Example, int3 codes [-4, 3, 0, 1, ...]:
u = [0b000, 0b111, 0b100, 0b101, ...], byte 0 = u0 | u1 << 3 | (u2 & 0b11) << 6 = 0b00111000.
A kernel loads b bytes (one 64-bit word) per 8 codes and extracts field j as (word >> j b) & (2^b - 1).

Note [Ternary bit planes]
~~~~~~~~~~~~~~~~~~~~~~~~~
``ternary=True`` stores int2 codes that are all in {-1, 0, 1} as two bit planes per 8 codes. int2 with
MappingType.SYMMETRIC_NO_CLIPPING_ERR and absmax calibration (the default) gives exactly such codes
(scale = block absmax), and weights whose blocks hold {-a, 0, a} (BitNet b1.58-style) round-trip exactly.
For codes 8 m .. 8 m + 7 of a row, byte 2 m holds the "nonzero" bits and byte 2 m + 1 the "negative"
bits, bit j for code 8 m + j; q = nonzero * (1 - 2 * negative). Example: codes [1, -1, 0, 0, 1, 1, -1, 0]
-> bytes [0b01110011, 0b01000010]. Still 2 bits per weight, but
a kernel needs no multiplies: the planes are masks that add or subtract activations directly
(AVX-512 mask registers on CPU, predicated adds on GPU). A "negative" bit without "nonzero"
never occurs (it would read as 0). Packing refuses a -2 code with an error naming the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.primitives import MappingType, ZeroPointDomain, pad_to, padded_shape
from ..core.qdtype import QKind, int2, int4, int8
from ..kernels.ops.linear_intxwo import intx_fields, pack_intx_fields
from ..kernels.ops.linear_ternarywo import ternary_codes
from ..kernels.preference import KernelPreference
from .base import (Layout, PackedSpec, PlainParts, WeightFormat, kernel_reach_problem, pad_features, register_layout,
                   scale_specs)
from .routes import GroupedRoute, Route, grouped_on_fake_quantized_input, on_fake_quantized_input



@register_layout("packed_intx")
@dataclass(frozen=True)
class PackedIntxLayout(Layout):
    """1- to 7-bit integer codes packed densely along in_features, or ternary weights as bit planes (layout name
    ``"packed_intx"``).

    Every 8 b-bit codes fill exactly b bytes, each row starting on a byte boundary; inner tensors ``qdata``
    (uint8), ``scale`` and ``zero_point`` (None without a zero point). It is the default layout of
    ``IntxWeightOnlyConfig`` below 8 bits and of ``Int8DynamicActivationIntxWeightConfig`` at 4 bits. Weight-only
    linears run ``torchqkit::linear_intxwo``, int8 or int4 dynamic activations x int4
    ``torchqkit::linear_int8da_int4_packed``;
    ternary planes ``torchqkit::linear_ternarywo`` (additions of table entries, no multiplies by weights); other
    activation quantization runs the weight-only op on the fake-quantized input.

    Args:
        ternary (bool): store int2 codes that are all in {-1, 0, 1} as two bit planes per 8 codes (still 2 bits
            per weight, no multiplies in a kernel); packing refuses a -2 code. Default False.

    Raises:
        ValueError: ``ternary`` is not True or False.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.IntxWeightOnlyConfig(bits=3, layout=qk.PackedIntxLayout()))
        ternary = qk.IntxWeightOnlyConfig(bits=2, granularity=qk.PerRow(), mapping="symmetric_no_clipping_err",
                                          layout=qk.PackedIntxLayout(ternary=True))
        ```
    """
    ternary: bool = False
    tensor_names = ("qdata", "scale", "zero_point")
    row_major = True

    def __post_init__(self):
        if not isinstance(self.ternary, bool):
            raise ValueError(f"PackedIntxLayout: ternary must be True or False, got {self.ternary!r}")

    def supports(self, fmt: WeightFormat):
        qdtype, block_size, shape, zero_point_domain = fmt
        if qdtype.kind is not QKind.INT:
            return f"PackedIntxLayout stores integer codes, not {qdtype.name}"
        if qdtype.bits >= 8:
            return f"PackedIntxLayout packs 1..7-bit codes; {qdtype.name} fills whole bytes: use PlainLayout"
        if len(shape) != 2:
            return f"PackedIntxLayout stores 2-d (out_features, in_features) weights, got shape {tuple(shape)}"
        if self.ternary and (qdtype != int2 or ZeroPointDomain(zero_point_domain) is not ZeroPointDomain.NONE):
            return (f"PackedIntxLayout(ternary=True) stores symmetric int2 codes in {{-1, 0, 1}}, got {qdtype.name} "
                    f"with zero point domain {ZeroPointDomain(zero_point_domain).value}; use ternary=False")
        return None

    def kernel_range_problem(self, parts: PlainParts, fmt: WeightFormat, act_quant) -> str | None:
        if act_quant is None or act_quant.qdtype not in (int8, int4) or not parts.scale.numel():
            return None
        # torchqkit::linear_int8da_int4_packed sums integer activation codes (int8: |q| <= 128, and as much again
        # for an asymmetric activation's zero-point term: 256; int4: 16) times the weight, and applies the
        # activation scale last: the sum reaches 2^bits * K * max|w| whatever the activation's own magnitude.
        qdtype = fmt.qdtype
        w_max = float(parts.scale.float().abs().max()) * (qdtype.qmax - qdtype.qmin + 1)
        if parts.zero_point is not None and parts.zero_point.dtype.is_floating_point:
            w_max += float(parts.zero_point.float().abs().max())
        return kernel_reach_problem(self, 2 ** act_quant.qdtype.bits * fmt.shape[-1] * w_max,
                                    f"with {act_quant.qdtype.name} activations sum activation codes times the weight "
                                    f"over in_features in float32 before the activation scale")

    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        qdtype, block_size, shape, _ = fmt
        if dim == 0:
            return super().slice_multiple(fmt, dim)
        # Cut at whole bytes: the smallest code count whose bits fill whole bytes (ternary: 8-code planes).
        unit = 8 if self.ternary else 8 // math.gcd(qdtype.bits, 8)
        return unit if block_size[1] == shape[1] else math.lcm(unit, block_size[1])

    def row_bytes(self, qdtype, k: int) -> int:
        """Bytes one row of ``k`` codes takes."""
        return 2 * -(-k // 8) if self.ternary else -(-k * qdtype.bits // 8)

    def narrow(self, aqt, cut):
        """Rows along out_features; whole bytes (and blocks) along in_features: always a view."""
        begin = cut.codes[0]
        if cut.dim == 0:
            qdata = aqt.qdata.narrow(0, begin, cut.codes[1])
        else:
            first = self.row_bytes(aqt.qdtype, begin)  # begin cuts at a whole byte (slice_multiple)
            qdata = aqt.qdata.narrow(1, first, self.row_bytes(aqt.qdtype, begin + cut.stored[1]) - first)
        scales = {name: None if t is None else t.narrow(cut.dim, *cut.blocks)
                  for name, t in (("scale", aqt.scale), ("zero_point", aqt.zero_point))}
        return {"qdata": qdata, **scales}, self

    def packed_specs(self, fmt: WeightFormat):
        qdtype, block_size, shape, zero_point_domain = fmt
        stored_k = padded_shape(shape, block_size)[1]
        return {"qdata": PackedSpec((shape[0], self.row_bytes(qdtype, stored_k)), (torch.uint8,)),
                **scale_specs(shape, block_size, zero_point_domain)}

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        qdtype, block_size = fmt.qdtype, fmt.block_size
        codes = pad_to(parts.qdata, (parts.qdata.shape[0], padded_shape(parts.qdata.shape, block_size)[1]))
        if self.ternary:
            bad = int((codes == -2).sum())
            if bad:
                raise ValueError(
                    f"PackedIntxLayout(ternary=True): {bad} of {codes.numel()} int2 codes are -2, which ternary packing "
                    f"can't store. Quantize with MappingType.SYMMETRIC_NO_CLIPPING_ERR and absmax calibration "
                    f"(codes in {{-1, 0, 1}}), or use PackedIntxLayout() for general int2 codes.")
            qdata = _pack_ternary(codes)
        else:
            fields = (codes.to(torch.int16) - int(qdtype.qmin)).to(torch.uint8)
            qdata = pack_intx_fields(fields, qdtype.bits)
        return {"qdata": qdata, "scale": parts.scale, "zero_point": parts.zero_point}

    def unpack(self, aqt) -> PlainParts:
        k = aqt.logical_shape[1]
        if self.ternary:
            codes = ternary_codes(aqt.qdata, k)  # the op reference's decoder
        else:
            fields = intx_fields(aqt.qdata, aqt.qdtype.bits, k)  # the op references' decoder
            codes = (fields.to(torch.int16) + int(aqt.qdtype.qmin)).to(aqt.qdtype.storage_dtype)
        return PlainParts(codes, aqt.scale, aqt.zero_point)


# ------------------------------------------------------------------------------------------------
# bit packing, see Note [Packed intx bits] and Note [Ternary bit planes]
# ------------------------------------------------------------------------------------------------

def _pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 codes in {-1, 0, 1} -> (N, 2 * ceil(K / 8)) uint8: per 8 codes a nonzero and a negative byte."""
    n, k = codes.shape
    k8 = -(-k // 8) * 8
    planes = torch.stack([codes != 0, codes < 0], dim=-1).to(torch.int64)  # (N, K, 2)
    planes = F.pad(planes, (0, 0, 0, k8 - k)).reshape(n, k8 // 8, 8, 2)
    weights = (1 << torch.arange(8, device=codes.device)).reshape(8, 1)
    return (planes * weights).sum(-2).reshape(n, k8 // 4).to(torch.uint8)


# ------------------------------------------------------------------------------------------------
# ops
# ------------------------------------------------------------------------------------------------

def _stored_k(w) -> int:
    return padded_shape(w.logical_shape, w.block_size)[1]  # kernels read whole groups (zero-padded x)


def _int8_int4_applies(w, x) -> bool:
    """int8 or int4 dynamic act (per token, or per token and weight group) x int4 (symmetric, integer or float zero
    point), per group of 8 k dividing 128 (or a multiple of 128) or per channel: the
    torchqkit::linear_int8da_int4_packed kernel takes it (int4 codes are int8 codes of a smaller range)."""
    spec = w.act_quant
    if (spec is None or w.qlayout.ternary or w.qdtype != int4 or spec.qdtype not in (int8, int4)
            or spec.static_scale is not None or spec.mapping not in (MappingType.SYMMETRIC, MappingType.ASYMMETRIC)
            or w.block_size[0] != 1):
        return False
    # int4 codes: the integer kernel is a C++ CPU one; on a GPU, or with a backend asked for, the route below runs
    # the weight-only op (which has a Triton kernel) on the fake-quantized input instead
    if spec.qdtype == int4 and (x.device.type != "cpu" or w.kernel_preference is not KernelPreference.AUTO):
        return False
    g, k = w.block_size[1], w.logical_shape[1]
    if spec.group_size is not None and (spec.group_size != g or g >= k):
        return False
    return g == k or (g % 8 == 0 and (128 % g == 0 or g % 128 == 0))


def _int8_int4_call(fn, w, x, bias):
    return fn(pad_features(x, _stored_k(w)), w.qdata, w.scale, w.zero_point, bias,
              w.act_quant.mapping is MappingType.SYMMETRIC, w.act_quant.group_size or 0, w.act_quant.qdtype.bits)


def _intx_call(fn, w, x, bias):
    return fn(pad_features(x, _stored_k(w)), w.qdata, w.scale, w.zero_point, w.qdtype.bits, w.qdtype.signed,
              ZeroPointDomain(w.zero_point_domain).value, bias)


def _intx_grouped_call(fn, tensors, w, x, offs):
    return fn(pad_features(x, _stored_k(w)), offs, tensors["qdata"], tensors["scale"], tensors["zero_point"],
              w.qdtype.bits, w.qdtype.signed, ZeroPointDomain(w.zero_point_domain).value)


def _ternary_call(fn, w, x, bias):
    return fn(pad_features(x, _stored_k(w)), w.qdata, w.scale, bias)


def _ternary_grouped_call(fn, tensors, w, x, offs):
    return fn(pad_features(x, _stored_k(w)), offs, tensors["qdata"], tensors["scale"])


def _int8_int4_grouped_call(fn, tensors, w, x, offs):
    return fn(pad_features(x, _stored_k(w)), offs, tensors["qdata"], tensors["scale"], tensors["zero_point"],
              w.act_quant.mapping is MappingType.SYMMETRIC, w.act_quant.group_size or 0, w.act_quant.qdtype.bits)


PackedIntxLayout.routes = (
    Route("1..7-bit int weight-only (any zero point domain, per-group / per-row), not ternary",
          lambda w, x: w.act_quant is None and not w.qlayout.ternary, op="torchqkit::linear_intxwo", call=_intx_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_intxwo", _intx_grouped_call)),
    Route("ternary weight-only (int2 codes in {-1, 0, 1} as bit planes), per-group / per-row",
          lambda w, x: w.act_quant is None and w.qlayout.ternary, op="torchqkit::linear_ternarywo",
          call=_ternary_call, grouped=GroupedRoute("torchqkit::grouped_linear_ternarywo", _ternary_grouped_call)),
    Route("int8 or int4 dynamic act (per token, or per token and weight group) x int4 (symmetric / int or float "
          "zero point), per group of 8..128 (dividing 128) or multiples of 128, or per channel", _int8_int4_applies,
          op="torchqkit::linear_int8da_int4_packed", call=_int8_int4_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_int8da_int4_packed", _int8_int4_grouped_call)),
    Route("any other activation quantization (float8; int8 / int4 the kernel above doesn't take) x 1..7-bit int "
          "weight, not ternary: activations fake-quantized, then the weight-only kernel",
          lambda w, x: w.act_quant is not None and not w.qlayout.ternary, op="torchqkit::linear_intxwo",
          call=on_fake_quantized_input(_intx_call),
          grouped=GroupedRoute("torchqkit::grouped_linear_intxwo",
                               grouped_on_fake_quantized_input(_intx_grouped_call))),
    Route("ternary planes x any activation quantization: activations fake-quantized, then the weight-only kernel",
          lambda w, x: w.act_quant is not None and w.qlayout.ternary, op="torchqkit::linear_ternarywo",
          call=on_fake_quantized_input(_ternary_call),
          grouped=GroupedRoute("torchqkit::grouped_linear_ternarywo",
                               grouped_on_fake_quantized_input(_ternary_grouped_call))),
)
