"""compressed-tensors checkpoints (llm-compressor's output, the format vLLM serves) read into torchqkit's plain form.

config.json's ``quantization_config`` holds ``config_groups`` (each: ``targets``, ``weights`` and optionally
``input_activations`` QuantizationArgs, and a ``format`` when the top-level one is "mixed-precision"), an ``ignore``
list and the storage ``format``. A Linear takes the first group whose targets match it and that ``ignore`` doesn't
name (compressed_tensors' own matching: class name, module name, or "re:" regular expression). The formats
read (tensor layouts: compressed_tensors_schemes.py): pack-quantized (int 2 / 4 / 8-bit, channel or group, symmetric
or asymmetric, actorder "group"'s ``weight_g_idx``), int-quantized, float-quantized, mxfp4-pack-quantized and
nvfp4-pack-quantized (weight-only: NVFP4Layout holds its three tensors as they are, whatever the global scale).
A mixture-of-experts model's per-expert Linears are joined into its expert stacks (hub_import.py, hub_experts.py).
"""
from __future__ import annotations

import torch

from ..core.qdtype import INT, float8_e4m3fn, fp4_e2m1, int8
from ..kernels.ops.linear_nvfp4wo import nvfp4_block_scales
from ..layouts.nvfp4 import NVFP4Layout
from ..serialization.safetensors_file import CheckpointError
from .hub_formats import (DecodedWeight, HubFormat, ModuleScheme, TensorProblem, act_spec, check_g_idx,
                          module_matcher, unsigned_codes)
from .int32_packing import PACKED_BITS

__all__ = ["compressed_tensors_format"]

_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "mxfp4-pack-quantized", "nvfp4-pack-quantized")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int64, torch.int32)


def compressed_tensors_format(qc: dict, where: str) -> HubFormat:
    """The HubFormat of a compressed-tensors ``quantization_config``; CheckpointError for what can't be read."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: config_groups must be a non-empty object")
    top = qc.get("format", "dense")
    # What would change the model's outputs beyond its weights: never dropped silently.
    for key, what in (("transform_config", "transforms (rotations)"), ("sparsity_config", "sparsity compression"),
                      ("kv_cache_scheme", "KV cache quantization")):
        if qc.get(key):
            raise CheckpointError(f"{where}: {key} describes {what}, which torchqkit does not import; load it with "
                                  f"transformers and the compressed-tensors package")
    schemes = []
    for gname, group in groups.items():
        at = f"{where}: config_groups.{gname}"
        if not isinstance(group, dict):
            raise CheckpointError(f"{at}: must be an object")
        if group.get("output_activations"):
            raise CheckpointError(f"{at}: output_activations quantization is not imported by torchqkit")
        fmt = group.get("format") or top
        if fmt not in _FORMATS:
            raise CheckpointError(f"{at}: format {fmt!r:.60} is not one torchqkit imports ({', '.join(_FORMATS)}); "
                                  f"load it with transformers and the compressed-tensors package")
        matches = module_matcher(group.get("targets"), at)
        schemes.append((matches, _scheme(fmt, group.get("weights"), group.get("input_activations"), at)))
    ignored = module_matcher(qc.get("ignore") or [], f"{where}: ignore")

    def scheme_for(name, module, stored):
        if ignored(name, module):
            return None
        return next((s for matches, s in schemes if matches(name, module)), None)

    return HubFormat(f"compressed-tensors {top}", scheme_for)


def _scheme(fmt: str, w, acts, at: str) -> ModuleScheme:
    if not isinstance(w, dict):
        raise CheckpointError(f"{at}: weights must be an object of QuantizationArgs")
    strategy, bits, kind = w.get("strategy"), w.get("num_bits"), w.get("type")
    symmetric = w.get("symmetric", True)
    if fmt == "pack-quantized" and (kind != "int" or bits not in PACKED_BITS or strategy not in ("channel", "group")):
        raise CheckpointError(f"{at}: pack-quantized weights {w!r:.160} are not int {PACKED_BITS}-bit channel or "
                              f"group quantization, which torchqkit imports")
    if fmt == "int-quantized" and (kind != "int" or bits != 8 or strategy not in ("channel", "group", "tensor")):
        raise CheckpointError(f"{at}: int-quantized weights {w!r:.160} are not int8 per channel, group or tensor")
    if fmt == "float-quantized" and (kind != "float" or bits != 8 or strategy not in ("channel", "tensor", "block")
                                     or not symmetric):
        raise CheckpointError(f"{at}: float-quantized weights {w!r:.160} are not symmetric float8 per channel, "
                              f"tensor or block")
    if fmt == "mxfp4-pack-quantized" and (kind != "float" or bits != 4 or strategy != "group"
                                          or w.get("group_size") != 32 or not symmetric or acts is not None):
        raise CheckpointError(f"{at}: mxfp4-pack-quantized weights {w!r:.160} (with input_activations "
                              f"{acts!r:.80}) are not MXFP4 weight-only (fp4, groups of 32), which torchqkit imports")
    if fmt == "nvfp4-pack-quantized" and (kind != "float" or bits != 4 or strategy not in ("tensor_group", "group")
                                          or w.get("group_size") != 16 or not symmetric or acts is not None):
        raise CheckpointError(f"{at}: nvfp4-pack-quantized weights {w!r:.160} (with input_activations {acts!r:.80}) "
                              f"are not NVFP4 weight-only (fp4, float8 scales per 16), which torchqkit imports (W4A4 "
                              f"checkpoints' calibrated input_global_scale has no torchqkit form)")
    group = w.get("group_size")
    if strategy in ("group", "tensor_group") and (type(group) is not int or group < 1):
        raise CheckpointError(f"{at}: group strategy needs an integer group_size >= 1, got {group!r:.40}")
    block = w.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2
                                    and all(type(b) is int and b >= 1 for b in block)):
        raise CheckpointError(f"{at}: block strategy needs block_structure [rows, cols], got {block!r:.40}")
    # actorder "group" (compressed-tensors before 0.20) stores weight_g_idx; "weight" reorders only during
    # calibration and stores nothing.
    actorder = w.get("actorder") == "group"
    if acts is not None and not isinstance(acts, dict):
        raise CheckpointError(f"{at}: input_activations must be an object or null")
    static = acts is not None and acts.get("dynamic") is False
    act_spec(acts, at, 1.0 if static else None)  # refuse what can't be served before any tensor is read
    layout = _Layout(fmt, bits, strategy, group, block, symmetric, actorder, static)
    return ModuleScheme(layout.shapes, lambda t, n, k: layout.decode(t, n, k, acts, at))


class _Layout:
    """One config group's tensors: shapes to check, and their decoding."""

    def __init__(self, fmt, bits, strategy, group, block, symmetric, actorder, static):
        self.fmt, self.bits, self.strategy, self.group, self.block = fmt, bits, strategy, group, block
        self.symmetric, self.actorder, self.static = symmetric, actorder, static

    def block_size(self, n: int, k: int) -> tuple[int, int]:
        sizes = {"channel": (1, k), "group": (1, self.group), "tensor_group": (1, self.group), "tensor": (n, k)}
        return sizes.get(self.strategy, tuple(self.block or ()))

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        bn, bk = self.block_size(n, k)
        return -(-n // bn), -(-k // bk)

    def shapes(self, n: int, k: int) -> dict:
        scale = self.scale_shape(n, k)
        if self.strategy == "tensor":
            scale = [(1,), (1, 1)]  # compressed-tensors writes (1,) for a per-tensor scale
        if self.fmt == "mxfp4-pack-quantized":  # byte for byte MXLayout's (compressed_tensors_schemes.py)
            if k % 32:
                raise CheckpointError(f"a Linear with in_features {k} can't hold MXFP4 blocks of 32")
            return {"weight_packed": ((n, k // 2), (torch.uint8,)), "weight_scale": ((n, k // 32), (torch.uint8,))}
        if self.fmt == "nvfp4-pack-quantized":  # byte for byte NVFP4Layout's (compressed_tensors_schemes.py)
            if k % 16:
                raise CheckpointError(f"a Linear with in_features {k} can't hold NVFP4 blocks of 16")
            return {"weight_packed": ((n, k // 2), (torch.uint8,)),
                    "weight_scale": ((n, k // 16), (torch.float8_e4m3fn,)),
                    "weight_global_scale": ([(1,), ()], (torch.float32,))}
        if self.fmt == "pack-quantized":
            out = {"weight_packed": ((n, -(-k * self.bits // 32)), (torch.int32,)), "weight_scale": (scale, _FLOATS),
                   "weight_shape": ((2,), _INTS)}
            if not self.symmetric:
                out["weight_zero_point"] = ((-(-n * self.bits // 32), scale[1]), (torch.int32,))
        else:
            code = torch.int8 if self.fmt == "int-quantized" else torch.float8_e4m3fn
            out = {"weight": ((n, k), (code,)), "weight_scale": (scale, _FLOATS)}
            if not self.symmetric:
                out["weight_zero_point"] = (scale, (torch.int8,))
        if self.actorder:
            out["weight_g_idx"] = ((k,), _INTS)
        if self.static:
            out["input_scale"] = ([(1,), (1, 1)], _FLOATS)
        return out

    def decode(self, t: dict, n: int, k: int, acts, at: str) -> DecodedWeight:
        block = self.block_size(n, k)
        if self.fmt == "mxfp4-pack-quantized":
            packed = t["weight_packed"]
            codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, k)  # element 2j: low nibble
            if bool((t["weight_scale"] == 255).any()):
                raise TensorProblem("weight_scale", "holds E8M0 byte 255 (NaN): the checkpoint is corrupt")
            # E8M0 byte e -> 2^(e - 127), exact in float32
            scale = torch.ldexp(torch.ones(n, k // 32), t["weight_scale"].to(torch.int32) - 127)
            return DecodedWeight(fp4_e2m1, codes, scale, None, block, None, None,
                                 "compressed-tensors mxfp4-pack-quantized fp4_e2m1 group 32", torch.bfloat16)
        if self.fmt == "nvfp4-pack-quantized":
            return _nvfp4(t, n, k, block)
        scale = t["weight_scale"].reshape(self.scale_shape(n, k))
        static = float(t["input_scale"].reshape(-1)[0]) if self.static else None
        act = act_spec(acts, at, static)
        zp = t.get("weight_zero_point")
        if self.fmt == "pack-quantized":
            stored = [int(v) for v in t["weight_shape"].tolist()]
            if stored != [n, k]:
                raise TensorProblem("weight_shape", f"records {stored}, but the Linear is [{n}, {k}]")
            half = 1 << (self.bits - 1)
            codes = (unsigned_codes(t["weight_packed"], self.bits, k, "weight_packed").to(torch.int16) - half)
            codes, qdtype = codes.to(torch.int8), INT[self.bits]
            if zp is not None:  # packed along N: unpack the transpose
                zp = unsigned_codes(zp.t().contiguous(), self.bits, n, "weight_zero_point").t()
                zp = (zp.to(torch.int16) - half).to(torch.int8).contiguous()
        else:
            codes, qdtype = t["weight"], (int8 if self.fmt == "int-quantized" else float8_e4m3fn)
        g_idx = None
        if self.actorder:
            g_idx = check_g_idx(t["weight_g_idx"], k, block[1], scale.shape[1], "weight_g_idx")
        what = f"compressed-tensors {self.fmt} {qdtype.name} {self.strategy}"
        what += f" {self.group}" if self.strategy == "group" else ""
        return DecodedWeight(qdtype, codes, scale, zp, block, g_idx, act, what)


def _nvfp4(t: dict, n: int, k: int, block) -> DecodedWeight:
    """NVFP4Layout's own tensors (the oracle's form alongside, for the report): the global scale is a divisor."""
    g = t["weight_global_scale"].reshape(1).float()
    if not (bool(torch.isfinite(g).all()) and float(g) > 0):
        raise TensorProblem("weight_global_scale", f"is {float(g):.4g}; a global scale must be finite and > 0")
    tensors = {"qdata": t["weight_packed"].contiguous(), "scale": t["weight_scale"].contiguous(), "global_scale": g}
    layout = NVFP4Layout()
    codes = torch.stack([tensors["qdata"] & 0xF, tensors["qdata"] >> 4], dim=-1).reshape(n, k)
    return DecodedWeight(fp4_e2m1, codes, nvfp4_block_scales(tensors["scale"], g), None, block, None, None,
                         "compressed-tensors nvfp4-pack-quantized fp4_e2m1 float8 scales per 16", torch.bfloat16,
                         stored=(layout, tensors))
