"""compressed-tensors schemes <-> torchqkit weight formats: which quantized weights have an exact compressed-tensors
form, and the tensors that form stores.

compressed-tensors (the format vLLM, SGLang and transformers' ``compressed-tensors`` quantizer read) describes a
weight by ``QuantizationArgs`` (num_bits, type "int" / "float", symmetric, strategy "tensor" / "channel" / "group"
/ "block", group_size, block_structure) and dequantizes it as ``(q - zero_point) * scale`` in the scale's dtype,
with signed codes q. Three storage formats are mapped here, per module ``m``:
  pack-quantized   int 2 / 4 / 8-bit weights, channel or group strategy: ``m.weight_packed`` int32 (N, K b / 32),
                   ``m.weight_scale`` (N, G), ``m.weight_shape`` int64 [N, K], and for asymmetric weights
                   ``m.weight_zero_point`` int32 packed along N (Note [int32 bit streams] in int32_packing.py).
  int-quantized    int8 weights with int8 dynamic per-token activations: ``m.weight`` int8 (N, K),
                   ``m.weight_scale`` (N, 1).
  float-quantized  float8 e4m3 weights: ``m.weight`` float8_e4m3fn (N, K), ``m.weight_scale`` float32 (N, 1),
                   (1, 1) or per 2-d block; optional float8 activations, dynamic or with a static ``m.input_scale``.
  mxfp4-pack-quantized  MXFP4 weight-only: ``m.weight_packed`` uint8 (N, K / 2), ``m.weight_scale`` uint8 E8M0
                   (N, K / 32): byte for byte MXLayout's ``qdata`` and ``scale`` (Note [MX bit layout] in
                   layouts/mx.py: element 2j in the low nibble, sign | 2 exponent bits | 1 mantissa bit, scale
                   2^(e - 127)). compressed-tensors dequantizes it in bfloat16.
  nvfp4-pack-quantized  NVFP4 weight-only: ``m.weight_packed`` uint8 (N, K / 2) (MXFP4's nibble order),
                   ``m.weight_scale`` float8_e4m3fn (N, K / 16), ``m.weight_global_scale`` float32 (1,), a divisor
                   (w = e2m1 * weight_scale / weight_global_scale): byte for byte NVFP4Layout's ``qdata``, ``scale``
                   and ``global_scale`` (Note [NVFP4 bit layout] in layouts/nvfp4.py).
Every mapping is exact: torchqkit's codes and scales are written as they are (unsigned codes with an integer
zero point shift by 2^(b-1) on both, which changes no difference q - z). What has no exact form (a float-domain
zero point, as Int4WeightOnlyConfig's; groups that don't divide K; codebooks; an AWQ input scale) is refused.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.granularity import PerRow, PerTensor, PerToken
from ..core.primitives import MappingType, ZeroPointDomain
from ..core.qdtype import QKind, float8_e4m3fn, fp4_e2m1, int8
from ..layouts.mx import MX_BLOCK, MXLayout
from ..layouts.nvfp4 import NVFP4Layout
from ..kernels.ops.linear_nvfp4wo import NVFP4_BLOCK
from .int32_packing import PACKED_BITS, pack_int32

__all__ = ["CTScheme", "ct_scheme", "ct_tensors", "MAPPABLE_CONFIGS"]

PACK_QUANTIZED, INT_QUANTIZED, FLOAT_QUANTIZED = "pack-quantized", "int-quantized", "float-quantized"
MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
# compressed-tensors' MXFP4A16 preset: fp4 elements, groups of 32, uint8 (E8M0) scales.
MXFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": MX_BLOCK,
                 "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}
NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
# compressed-tensors' NVFP4A16 preset: fp4 elements, float8 scales per 16 under a float32 global scale.
NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                 "group_size": NVFP4_BLOCK, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn",
                 "zp_dtype": "torch.float8_e4m3fn"}

# What a user can choose instead, named in every refusal.
MAPPABLE_CONFIGS = ("IntxWeightOnlyConfig(bits=2|4|8, granularity=PerGroup(g) or PerRow(), mapping='symmetric' or "
                    "'asymmetric') -> pack-quantized; Int8WeightOnlyConfig() -> pack-quantized; "
                    "Int8DynamicActivationInt8WeightConfig() -> int-quantized; Float8WeightOnlyConfig() / "
                    "Float8DynamicActivationFloat8WeightConfig() (float8_e4m3fn) -> float-quantized; "
                    "MXFP4WeightOnlyConfig() -> mxfp4-pack-quantized; NVFP4WeightOnlyConfig() -> "
                    "nvfp4-pack-quantized; or keep the "
                    "module in float (ModuleConfigs({'<name>': None}))")


class CTScheme(NamedTuple):
    """One weight's compressed-tensors description: its storage format and QuantizationArgs (as JSON)."""
    format: str
    weights: dict
    input_activations: dict | None

    def key(self) -> str:
        """A canonical text, equal for weights that can share one config group."""
        import json
        return json.dumps([self.format, self.weights, self.input_activations], sort_keys=True)


def ct_scheme(w) -> CTScheme | str:
    """The exact compressed-tensors scheme of quantized weight ``w`` (an AffineQuantizedTensor), or why there is
    none."""
    if w.transposed or len(w.logical_shape) != 2:
        kind = "transposed" if w.transposed else f"{len(w.logical_shape)}-d"
        return f"a {kind} weight (compressed-tensors stores (N, K))"
    if w.input_scale is not None:
        return "it carries a per-input-feature scale (AWQ / SmoothQuant input_scale) that compressed-tensors can't hold"
    if isinstance(w.qlayout, NVFP4Layout) and w.act_quant is not None:
        return ("NVFP4 activations with a global scale chosen per call (compressed-tensors' NVFP4 reads a calibrated "
                "input_global_scale; mapped: NVFP4WeightOnlyConfig)")
    acts = _activation_args(w.act_quant)
    if isinstance(acts, str):
        return acts
    if w.qdtype == fp4_e2m1 and isinstance(w.qlayout, MXLayout):
        return _mxfp4_scheme(w, acts)
    if isinstance(w.qlayout, NVFP4Layout):
        return _nvfp4_scheme(w, acts)
    if w.qdtype.kind is QKind.FLOAT8:
        return _float8_scheme(w, acts)
    if w.qdtype.kind is not QKind.INT:
        return f"{w.qdtype.name} codes (compressed-tensors' int / float schemes have no codebook)"
    return _int_scheme(w, acts)


def _strategy(w) -> dict | str:
    n, k = w.logical_shape
    bn, bk = w.block_size
    if bn == 1 and bk >= k:
        return {"strategy": "channel"}
    if bn == 1:
        if k % bk:
            return (f"groups of {bk} don't divide in_features {k} (compressed-tensors' group strategy needs whole "
                    f"groups)")
        return {"strategy": "group", "group_size": bk}
    if bn >= n and bk >= k:
        return {"strategy": "tensor"}
    return {"strategy": "block", "block_structure": [bn, bk]}


def _int_scheme(w, acts) -> CTScheme | str:
    bits = w.qdtype.bits
    zpd = w.zero_point_domain
    if zpd is ZeroPointDomain.FLOAT:
        return ("its zero point is in the float domain (w = (q - mid) s + z, Int4WeightOnlyConfig's tinygemm "
                "convention); compressed-tensors stores integer zero points (w = (q - z) s)")
    if bits not in PACKED_BITS:
        return f"{bits}-bit codes (compressed-tensors' packing is served for {PACKED_BITS} bits)"
    strategy = _strategy(w)
    if isinstance(strategy, str):
        return strategy
    if strategy["strategy"] not in ("channel", "group"):
        return f"{strategy['strategy']} scales on int codes (pack-quantized takes channel or group scales)"
    if zpd is ZeroPointDomain.INT and w.zero_point is not None:
        half = 1 << (bits - 1)
        zp = w.qlayout.unpack(w).zero_point.to(torch.int32) - (0 if w.qdtype.signed else half)
        if int(zp.min()) < -half or int(zp.max()) >= half:
            return f"integer zero points outside the signed {bits}-bit range [{-half}, {half - 1}]"
    weights = {"num_bits": bits, "type": "int", "symmetric": zpd is ZeroPointDomain.NONE, **strategy,
               "dynamic": False}
    int_acts = acts is not None and acts["type"] == "int"
    if acts is not None and not int_acts:
        return "float8 activations with int weights (compressed-tensors has no such scheme)"
    if int_acts and bits == 8 and zpd is ZeroPointDomain.NONE and strategy["strategy"] == "channel":
        return CTScheme(INT_QUANTIZED, weights, acts)
    return CTScheme(PACK_QUANTIZED, weights, acts)


def _float8_scheme(w, acts) -> CTScheme | str:
    if w.qdtype.is_fnuz:
        return _fnuz_refusal(w.qdtype, "codes", "weight_dtype")
    if w.qdtype != float8_e4m3fn:
        return f"{w.qdtype.name} codes (compressed-tensors' float8 is float8_e4m3fn)"
    strategy = _strategy(w)
    if isinstance(strategy, str):
        return strategy
    if acts is not None and acts["type"] != "float":
        return "int8 activations with float8 weights (compressed-tensors has no such scheme)"
    weights = {"num_bits": 8, "type": "float", "symmetric": True, **strategy, "dynamic": False}
    return CTScheme(FLOAT_QUANTIZED, weights, acts)


def _mxfp4_scheme(w, acts) -> CTScheme | str:
    if acts is not None:
        return "MXFP4 weights with quantized activations (mapped: MXFP4 weight-only)"
    if w.logical_shape[1] % MX_BLOCK:
        return f"in_features {w.logical_shape[1]} is not a multiple of {MX_BLOCK} (a partial MX block)"
    return CTScheme(MXFP4_PACK_QUANTIZED, dict(MXFP4_WEIGHTS), None)


def _nvfp4_scheme(w, acts) -> CTScheme | str:
    if w.logical_shape[1] % NVFP4_BLOCK:
        return f"in_features {w.logical_shape[1]} is not a multiple of {NVFP4_BLOCK} (a partial NVFP4 block)"
    return CTScheme(NVFP4_PACK_QUANTIZED, dict(NVFP4_WEIGHTS), None)


def _fnuz_refusal(qdtype, what: str, field: str) -> str:
    """Why AMD's fnuz float8 (Note [float8 fnuz] in core/qdtype.py) has no compressed-tensors form, and the way out."""
    return (f"{qdtype.name} {what}: compressed-tensors' float8 is OCP float8_e4m3fn and has no AMD fnuz form; quantize "
            f"with {field}='float8_e4m3fn' to export (ROCm engines convert e4m3fn to fnuz when they load), or keep "
            f"the fnuz codes in torchqkit's own checkpoint (save_pretrained)")


def _activation_args(spec) -> dict | None | str:
    """QuantizationArgs of ``spec`` (an ActivationQuantSpec) as JSON, or why compressed-tensors has none."""
    if spec is None:
        return None
    if spec.group_size is not None:
        return "per-group activation scales (compressed-tensors' dynamic activations are per token or per tensor)"
    if spec.qdtype == int8:
        kind = "int"
    elif spec.qdtype == float8_e4m3fn:
        kind = "float"
    elif spec.qdtype.is_fnuz:
        return _fnuz_refusal(spec.qdtype, "activations", "activation_dtype")
    else:
        return f"{spec.qdtype.name} activations (exported: int8 and float8_e4m3fn ones)"
    symmetric = spec.mapping is not MappingType.ASYMMETRIC
    if spec.static_scale is not None:
        return {"num_bits": 8, "type": kind, "symmetric": symmetric, "strategy": "tensor", "dynamic": False}
    if isinstance(spec.granularity, (PerToken, PerRow)):
        return {"num_bits": 8, "type": kind, "symmetric": symmetric, "strategy": "token", "dynamic": True}
    if isinstance(spec.granularity, PerTensor):
        return {"num_bits": 8, "type": kind, "symmetric": symmetric, "strategy": "tensor", "dynamic": True}
    return f"activation granularity {spec.granularity!r}"


def ct_tensors(w, scheme: CTScheme) -> dict[str, torch.Tensor]:
    """The tensors ``scheme`` stores for weight ``w``, by suffix ("weight_packed", "weight_scale", ...), holding
    ``w``'s own codes and scales."""
    if scheme.format == MXFP4_PACK_QUANTIZED:  # the same bytes (module docstring)
        return {"weight_packed": w.qdata.contiguous(), "weight_scale": w.scale.contiguous()}
    if scheme.format == NVFP4_PACK_QUANTIZED:  # the same bytes (module docstring)
        return {"weight_packed": w.qdata.contiguous(), "weight_scale": w.scale.contiguous(),
                "weight_global_scale": w.global_scale.float().contiguous()}
    parts = w.qlayout.unpack(w)
    n, k = w.logical_shape
    scale = parts.scale.reshape(-1, 1) if scheme.weights["strategy"] == "channel" else parts.scale
    out = {"weight_scale": scale.contiguous()}
    if scheme.format == FLOAT_QUANTIZED:
        out["weight"] = parts.qdata.contiguous()
    elif scheme.format == INT_QUANTIZED:
        out["weight"] = parts.qdata.to(torch.int8).contiguous()
    else:
        bits = scheme.weights["num_bits"]
        half = 1 << (bits - 1)
        # compressed-tensors' fields are signed codes + 2^(b-1); unsigned codes already are those fields.
        shift = half if w.qdtype.signed else 0
        out["weight_packed"] = pack_int32(parts.qdata.to(torch.int32) + shift, bits)
        out["weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not scheme.weights["symmetric"]:
            zp = parts.zero_point.to(torch.int32).reshape(n, -1) + shift
            out["weight_zero_point"] = pack_int32(zp.t(), bits).t().contiguous()  # packed along N (dim 0)
    if scheme.input_activations is not None and not scheme.input_activations["dynamic"]:
        out["input_scale"] = torch.tensor([w.act_quant.static_scale], dtype=torch.float32)
    return out
