"""MXLayout: OCP Microscaling (MX spec v1.0) MXFP8 / MXFP4 weights, one E8M0 scale per 32 elements of K.

Element formats: float8_e4m3fn (MXFP8 E4M3), float8_e5m2 (MXFP8 E5M2), fp4_e2m1 (MXFP4). Scales are
powers of two chosen by the oracle with ``scale_rounding="power_of_two"`` (see Note [Power-of-two scales]
in core/primitives.py: X = 2^(floor(log2(amax)) - emax_elem), elements saturate). Tensors (Kp = K rounded
up to whole blocks of 32, see Note [Partial blocks] in core/primitives.py; padded elements are code 0):
  qdata: MXFP8: (N, Kp) torch.float8_e4m3fn / float8_e5m2, one element per byte
         MXFP4: (N, Kp // 2) uint8, two e2m1 codes per byte, see Note [MX bit layout]
  scale: (N, Kp // 32) uint8, E8M0: the biased exponent e of X = 2^(e - 127); 255 (NaN) is never written
x = element * X. unpack() returns X as float32 (exact: 2^-127 .. 2^127 are all float32 values).

Note [MX bit layout]
~~~~~~~~~~~~~~~~~~~~
Row-major over (N, K); the 32 elements of block (n, b) are k = 32b .. 32b + 31, scale byte [n, b].
MXFP4: byte j of row n holds element 2j in its LOW nibble and element 2j + 1 in its HIGH nibble
(the order of torch.float4_e2m1fn_x2 and of NVIDIA's packed fp4): byte = code[n, 2j + 1] << 4 | code[n, 2j].
An e2m1 code is sign (bit 3) | exponent (bits 2..1, bias 1) | mantissa (bit 0): 0b0111 = 6.0, 0b1010 = -1.0.
MXFP8: the element's float8 bits, one byte each. E8M0: exponent bits only, no sign, no mantissa.

Linear runs torchqkit::linear_mxwo on the stored bytes (C++ on CPU: MXFP4 through a 16-entry e2m1 table,
MXFP8 through the float8 kernel, E8M0 exponents turned into float32 scales per call); the reference
(dequantize + F.linear) serves KernelPreference.REFERENCE and other activation dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.primitives import pad_to, padded_shape
from ..core.qdtype import float8_e4m3fn, float8_e5m2, fp4_e2m1
from ..kernels.ops.common import pack_nibbles, split_nibbles
from .base import Layout, PackedSpec, PlainParts, WeightFormat, pad_features, register_layout
from .routes import GroupedRoute, Route, grouped_on_fake_quantized_input, on_fake_quantized_input

MX_BLOCK = 32
E8M0_BIAS = 127
_ELEMENTS = (float8_e4m3fn, float8_e5m2, fp4_e2m1)
_FLOAT32_2_POW_M127 = 0x00400000  # float32 bits of 2^-127, the one subnormal E8M0 value


@register_layout("mx")
@dataclass(frozen=True)
class MXLayout(Layout):
    """OCP Microscaling (MX spec v1.0) MXFP8 / MXFP4 weights with one E8M0 scale per 32 elements of K (layout name
    ``"mx"``).

    Elements are float8_e4m3fn or float8_e5m2 (one per byte) or fp4_e2m1 (two per byte); ``scale`` is one uint8
    biased exponent per block of 32. Scales are powers of two, chosen with ``scale_rounding="power_of_two"``. The
    layout of ``MXFP8WeightOnlyConfig`` and ``MXFP4WeightOnlyConfig``; its linear runs ``torchqkit::linear_mxwo`` on
    the stored bytes.

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.fp4_e2m1, qk.PerGroup(32), qk.MXLayout(),
                               scale_dtype=torch.float32, scale_rounding="power_of_two")
        print(w.qdata.shape, w.scale.dtype)          # torch.Size([16, 32]) torch.uint8
        ```
    """
    tensor_names = ("qdata", "scale")
    row_major = True
    scale_rounding = "power_of_two"

    def supports(self, fmt: WeightFormat):
        if fmt.qdtype not in _ELEMENTS:
            return f"MXLayout stores {', '.join(q.name for q in _ELEMENTS)} elements, not {fmt.qdtype.name}"
        return self.symmetric_2d_problem(fmt, "power-of-two scaled elements (OCP MX)", block_k=MX_BLOCK)

    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        # MX blocks are 32 elements by definition: a slice along K never shrinks one.
        return MX_BLOCK if dim == 1 else 1

    def packed_specs(self, fmt: WeightFormat):
        qdtype, block_size, shape, _ = fmt
        n, k = padded_shape(shape, block_size)
        qdata = PackedSpec((n, k // 2), (torch.uint8,)) if qdtype is fp4_e2m1 else PackedSpec((n, k), (qdtype.storage_dtype,))
        return {"qdata": qdata, "scale": PackedSpec((n, k // MX_BLOCK), (torch.uint8,))}

    def pack(self, parts: PlainParts, fmt: WeightFormat):
        qdtype, block_size = fmt.qdtype, fmt.block_size
        codes = pad_to(parts.qdata, padded_shape(parts.qdata.shape, block_size))
        return {"qdata": pack_nibbles(codes) if qdtype is fp4_e2m1 else codes.contiguous(),
                "scale": _to_e8m0(parts.scale)}

    def unpack(self, aqt) -> PlainParts:
        q = aqt.qdata
        n, k = aqt.logical_shape
        if aqt.qdtype is fp4_e2m1:
            q = split_nibbles(q, high_first=False)
        return PlainParts(q[:n, :k], _from_e8m0(aqt.scale), None)

    def narrow(self, aqt, cut):
        """Whole 32-element blocks along K, any rows along N; both inner tensors are views."""
        per_byte = 2 if (aqt.qdtype is fp4_e2m1 and cut.dim == 1) else 1
        return {"qdata": aqt.qdata.narrow(cut.dim, cut.stored[0] // per_byte, cut.stored[1] // per_byte),
                "scale": aqt.scale.narrow(cut.dim, *cut.blocks)}, self

    def __repr__(self) -> str:
        return "MXLayout()"


def _to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """float power-of-two scales -> uint8 biased exponents; anything else is refused (it would be re-rounded)."""
    bits = scale.float().contiguous().view(torch.int32)
    normal = ((bits & 0x807FFFFF) == 0) & (bits != 0)  # positive, mantissa zero, not 0.0
    subnormal = bits == _FLOAT32_2_POW_M127
    # An infinite or NaN scale has a zero mantissa too (exponent field 0xFF): refused with the others.
    ok = (normal | subnormal) & ((bits >> 23) != 0xFF)
    if not scale.is_meta and not bool(ok.all()):
        bad = scale[~ok].flatten()[:4].tolist()
        raise ValueError(f"MXLayout stores E8M0 scales: every scale must be a power of two in 2^-127..2^127, got "
                         f"e.g. {bad}. Quantize with scale_rounding='power_of_two' (MXFP8WeightOnlyConfig / "
                         f"MXFP4WeightOnlyConfig do).")
    return torch.where(subnormal, 0, bits >> 23).to(torch.uint8)


def _from_e8m0(e: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2^(e - 127), built from bits (exact, also under torch.compile)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, _FLOAT32_2_POW_M127, torch.where(e == 255, 0x7FC00000, e << 23))
    return bits.view(torch.float32)


def _mx_call(fn, w, x, bias):
    return fn(pad_features(x, MX_BLOCK * w.scale.shape[1]), w.qdata, w.scale, bias)


def _mx_grouped_call(fn, tensors, w, x, offs):
    return fn(pad_features(x, MX_BLOCK * tensors["scale"].shape[2]), offs, tensors["qdata"], tensors["scale"])


MXLayout.routes = (
    Route("MXFP8 / MXFP4 weight-only", lambda w, x: w.act_quant is None, op="torchqkit::linear_mxwo", call=_mx_call,
          grouped=GroupedRoute("torchqkit::grouped_linear_mxwo", _mx_grouped_call)),
    Route("MXFP8 / MXFP4 weights x MXFP8 dynamic activations (per token and 32 features): activations "
          "fake-quantized, then the weight-only kernel", lambda w, x: w.act_quant is not None,
          op="torchqkit::linear_mxwo", call=on_fake_quantized_input(_mx_call),
          grouped=GroupedRoute("torchqkit::grouped_linear_mxwo", grouped_on_fake_quantized_input(_mx_grouped_call))),
)
