"""GPTQ, AWQ and compressed-tensors Linear weights decoded into torchqkit's plain form: codes, scales, zero points.

Each format is a ``HubFormat``: built from config.json's ``quantization_config`` (``parse_hub_format``), it says
which stored tensors a quantized Linear has (``tensor_shapes``: name suffix -> (shape, dtypes), checked against
the file before anything is read) and decodes them (``decode``) into a ``DecodedWeight`` holding the file's own
codes and scales, never re-rounded. What each format means, for a Linear of N outputs and K inputs, b-bit codes
and G groups of g inputs (the packings: Note [int32 bit streams] in int32_packing.py):
  GPTQ   qweight (K b/32, N), qzeros (G, N b/32), scales (G, N), g_idx (K,): w[n, k] = (q[n, k] -
         z[g_idx[k], n]) s[g_idx[k], n]. checkpoint_format "gptq" (AutoGPTQ's, the default) stores z - 1 in
         b bits: z = (stored + 1) mod 2^b, as its dequantization computes; "gptq_v2" stores z.
  AWQ    (version "gemm") qweight (K, N b/32), qzeros (G, N b/32), scales (G, N), words in AWQ's column order:
         w[n, k] = (q[n, k] - z[k // g, n]) s[k // g, n].
  compressed-tensors  see compressed_tensors_schemes.py: w = (q - z) s with signed q; pack-quantized (optionally
         with ``weight_g_idx`` for act-order), int-quantized and float-quantized.
The codes become unsigned b-bit codes with an integer zero point (GPTQ / AWQ) or signed codes with an optional
one (compressed-tensors), so torchqkit dequantizes (q - z) s exactly as the format does: the product of a small
integer and a 16- or 32-bit scale is exact in float32 and rounded once to the scale's dtype, as the reference
implementations (which compute in that dtype) round it.
"""
from __future__ import annotations

import re
from typing import Callable, NamedTuple

import torch

from ..core.granularity import PerTensor, PerToken
from ..core.primitives import MappingType
from ..core.qdtype import UINT, float8_e4m3fn, int8
from ..serialization.safetensors_file import CheckpointError
from ..tensor.activation import ActivationQuantSpec
from .int32_packing import PACKED_BITS, awq_deinterleave, stream_padding_is_zero, unpack_int32

__all__ = ["DecodedWeight", "HubFormat", "ModuleScheme", "TensorProblem", "act_spec", "module_matcher",
           "unsigned_codes", "check_g_idx", "parse_hub_format", "HUB_QUANT_METHODS"]

HUB_QUANT_METHODS = ("gptq", "awq", "compressed-tensors")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class DecodedWeight(NamedTuple):
    """One Linear weight in the oracle's form: codes (N, K), scale / zero point (N, G), groups of ``group`` inputs
    (``g_idx``: the group of each input, when not k // group), and how the linear quantizes its input."""
    qdtype: object
    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    block_size: tuple[int, int]
    g_idx: torch.Tensor | None
    act_quant: ActivationQuantSpec | None
    what: str
    dtype: torch.dtype | None = None  # what dequantize() returns; None: the scale's dtype
    # (layout, its inner tensors) when the checkpoint holds a layout's bytes as they are and pack() can't rebuild them
    # from codes and scale (NVFP4 with any float32 global scale); None: build_weight packs codes and scale.
    stored: tuple | None = None


class ModuleScheme(NamedTuple):
    """How one quantized Linear is stored."""
    tensor_shapes: Callable[[int, int], dict]          # (N, K) -> suffix -> (shape, dtypes); "?" suffix: optional
    decode: Callable[[dict, int, int], DecodedWeight]  # (suffix -> tensor, N, K) -> weight


class HubFormat(NamedTuple):
    """A checkpoint's quantization: its description, and the scheme of each module (None: stored in float)."""
    name: str                                                     # e.g. "gptq 4-bit group_size 128 ..."
    scheme_for: Callable[[str, object, set], ModuleScheme | None]  # (module name, module, stored tensor names)


_JSON_NAMES = {int: "an integer", str: "a string", bool: "true or false"}


def _bad(where: str, what: str):
    return CheckpointError(f"{where}: {what}")


class TensorProblem(CheckpointError):
    """A stored tensor's values are wrong; ``suffix`` names it within its module (the loader adds file and module)."""

    def __init__(self, suffix: str, what: str):
        super().__init__(f"{suffix}: {what}")
        self.suffix, self.what = suffix, what


def _field(qc: dict, key: str, kinds, where: str, default=None, choices=None):
    value = qc.get(key, default)
    if type(value) is not kinds:  # exact: JSON true is not an int
        raise _bad(where, f"{key} must be {_JSON_NAMES[kinds]}, got {value!r:.60}")
    if choices is not None and value not in choices:
        raise _bad(where, f"{key} {value!r:.60} is not supported (supported: {', '.join(map(str, choices))})")
    return value


def parse_hub_format(qc: dict, where: str) -> HubFormat:
    """The HubFormat of a ``quantization_config`` (CheckpointError starting with ``where`` when it can't be read)."""
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq(qc, where)
    if method == "awq":
        return _awq(qc, where)
    if method == "compressed-tensors":
        from .compressed_tensors_import import compressed_tensors_format
        return compressed_tensors_format(qc, where)
    raise _bad(where, f"quant_method {method!r:.60} is not one torchqkit imports ({', '.join(HUB_QUANT_METHODS)})")


def _group(qc: dict, key: str, where: str) -> int:
    g = _field(qc, key, int, where, 128)
    if g != -1 and g < 1:
        raise _bad(where, f"{key} must be -1 (one group per row) or >= 1, got {g}")
    return g


def _groups(k: int, g: int) -> tuple[int, int]:
    """(group size, number of groups) for K inputs; -1: one group of K."""
    g = k if g == -1 else g
    return g, -(-k // g)


def _where_qweight(scheme: ModuleScheme):
    """GPTQ / AWQ: a Linear is quantized when the files hold its ``qweight`` (their configs don't list the
    modules; lm_head usually stays float). A Linear with neither qweight nor weight is reported missing."""
    return lambda name, module, stored: scheme if f"{name}.qweight" in stored else None


def unsigned_codes(packed: torch.Tensor, bits: int, cols: int, where: str) -> torch.Tensor:
    if not stream_padding_is_zero(packed, bits, cols):
        raise TensorProblem(where, f"bits past the last {bits}-bit code of a row are set: the words were not packed as "
                          f"{bits}-bit codes of {cols} columns (the checkpoint's bits or shape disagree with the "
                          f"config)")
    return unpack_int32(packed, bits, cols)


def _gptq(qc: dict, where: str) -> HubFormat:
    bits = _field(qc, "bits", int, where, 4, PACKED_BITS)
    group = _group(qc, "group_size", where)
    version = _field(qc, "checkpoint_format", str, where, "gptq", ("gptq", "gptq_v2"))
    desc_act = _field(qc, "desc_act", bool, where, False)
    per_word = 32 // bits

    def shapes(n, k):
        g, groups = _groups(k, group)
        if k % per_word or n % per_word:
            raise _bad(where, f"a {n}x{k} Linear can't hold GPTQ's {bits}-bit packing (N and K must be multiples "
                              f"of {per_word})")
        return {"qweight": ((k // per_word, n), (torch.int32,)), "qzeros": ((groups, n // per_word), (torch.int32,)),
                "scales": ((groups, n), _FLOATS), "g_idx?": ((k,), (torch.int32, torch.int64))}

    def decode(t, n, k):
        g, groups = _groups(k, group)
        codes = unsigned_codes(t["qweight"].t().contiguous(), bits, k, "qweight")  # stream along K per column
        zeros = unsigned_codes(t["qzeros"], bits, n, "qzeros")                      # (G, N)
        if version == "gptq":  # AutoGPTQ's z - 1 in b bits, see the module docstring
            zeros = ((zeros.to(torch.int16) + 1) & ((1 << bits) - 1)).to(torch.uint8)
        g_idx = check_g_idx(t.get("g_idx"), k, g, groups)
        return DecodedWeight(UINT[bits], codes, t["scales"].t().contiguous(), zeros.t().contiguous(), (1, g), g_idx,
                             None, f"gptq uint{bits} g{g}{' act-order' if g_idx is not None else ''}")

    text = f"gptq {bits}-bit group_size {group} desc_act {desc_act} (checkpoint_format {version})"
    return HubFormat(text, _where_qweight(ModuleScheme(shapes, decode)))


def check_g_idx(g_idx, k: int, g: int, groups: int, name: str = "g_idx"):
    """None when g_idx is absent or the plain k // g; else the int64 group index of each input, all in range."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise TensorProblem(name, f"group indices must be in [0, {groups}) ({groups} groups of {g}), found "
                            f"{int(g_idx.min())}..{int(g_idx.max())}")
    return None if torch.equal(g_idx, torch.arange(k) // g) else g_idx


def _awq(qc: dict, where: str) -> HubFormat:
    bits = _field(qc, "bits", int, where, 4, (4,))
    group = _group(qc, "group_size", where)
    version = _field(qc, "version", str, where, "gemm", ("gemm", "GEMM"))
    if qc.get("zero_point", True) is not True:
        raise _bad(where, "zero_point false (symmetric AWQ) is not a packing torchqkit imports")

    def shapes(n, k):
        g, groups = _groups(k, group)
        if n % 8:
            raise _bad(where, f"a {n}x{k} Linear can't hold AWQ's packing (N must be a multiple of 8)")
        return {"qweight": ((k, n // 8), (torch.int32,)), "qzeros": ((groups, n // 8), (torch.int32,)),
                "scales": ((groups, n), _FLOATS)}

    def decode(t, n, k):
        g, groups = _groups(k, group)
        codes = awq_deinterleave(unsigned_codes(t["qweight"], bits, n, "qweight")).t().contiguous()  # (N, K)
        zeros = awq_deinterleave(unsigned_codes(t["qzeros"], bits, n, "qzeros")).t().contiguous()    # (N, G)
        return DecodedWeight(UINT[bits], codes, t["scales"].t().contiguous(), zeros, (1, g), None, None,
                             f"awq uint{bits} g{g}")

    text = f"awq {bits}-bit group_size {group} (version {version.lower()})"
    return HubFormat(text, _where_qweight(ModuleScheme(shapes, decode)))


def act_spec(args: dict | None, where: str, static_scale: float | None = None) -> ActivationQuantSpec | None:
    """torchqkit's activation spec for compressed-tensors ``input_activations`` args (None: weight-only)."""
    if args is None:
        return None
    kind = {"int": int8, "float": float8_e4m3fn}.get(args.get("type"))
    if kind is None or args.get("num_bits") != 8:
        raise _bad(where, f"input_activations {args!r:.120} are not 8-bit int or float")
    mapping = MappingType.SYMMETRIC if args.get("symmetric", True) else MappingType.ASYMMETRIC
    strategy = args.get("strategy")
    if args.get("dynamic") in (True, "local") and strategy in ("token", "tensor"):
        return ActivationQuantSpec(kind, PerToken() if strategy == "token" else PerTensor(), mapping)
    if args.get("dynamic") is False and strategy == "tensor" and static_scale is not None:
        return ActivationQuantSpec(kind, PerTensor(), mapping, static_scale=static_scale)
    raise _bad(where, f"input_activations {args!r:.120}: torchqkit imports dynamic per-token / per-tensor or static "
                      f"per-tensor activation quantization")


def module_matcher(targets: list, where: str) -> Callable[[str, object], bool]:
    """compressed-tensors' target / ignore matching: a class name ("Linear"), "re:<regex>" on the module name, or
    the module name itself."""
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _bad(where, f"targets / ignore must be lists of strings, got {targets!r:.80}")
    try:
        patterns = [re.compile(t[3:]) for t in targets if t.startswith("re:")]
    except re.error as e:
        raise _bad(where, f"a target pattern is not a valid regular expression ({e})") from None
    plain = {t for t in targets if not t.startswith("re:")}
    return lambda name, module, stored=None: (name in plain or type(module).__name__ in plain
                                 or any(p.match(name) for p in patterns))
