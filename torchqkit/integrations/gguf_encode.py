"""A quantized weight's codes and qparams as GGUF blocks, written only where the GGUF type holds them exactly.

Note [Exact GGUF targets]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every affine layout dequantizes a group as ``w = s q + b`` (``b`` = 0 without a zero point, ``-z s`` for an
integer zero point, ``z - mid s`` for a float one). GGUF's legacy types hold blocks of 32 weights along K:
  Q4_0  w = d (u - 8),  u in 0..15        Q5_0  w = d (u - 16), u in 0..31      Q8_0  w = d u, u in -128..127
  Q4_1  w = d u + m,    u in 0..15        Q5_1  w = d u + m,    u in 0..31
A torchqkit group of any multiple of 32 along K (or a whole row of a multiple of 32) is several GGUF blocks with
the same ``d`` (and ``m``). The symmetric types take a group whose ``b`` is zero after an integer shift of the
codes: no zero point, an integer zero point (``u`` = q - z + 8 for Q4_0), or a float zero point that is exactly 0
(``u`` = q - mid + 8). The asymmetric types take any group: ``u = q - qmin`` and ``m = b + qmin s``. The first
of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (fewest bits per weight) whose code range holds every shifted code of the tensor
is written. The codes are then the source's own, shifted by an integer; ``d`` and ``m`` are float16 in the file,
so a float32 scale (or a min computed from it) is rounded to the nearest float16: the only change, which the
report counts per tensor. Nothing else is ever rounded: a scale outside float16's range, a group that doesn't
cover whole 32-blocks, a K that is not a multiple of 32, codes that fit no type, a codebook or float format
(NF4, float8, MX) or an AWQ input scale have no exact target, and ``encode_exact`` says why (save_gguf raises,
or with ``requantize=True`` re-rounds the dequantized weight with gguf-py's quantizer and says so).

Before a tensor is accepted its bytes are checked independently: gguf-py's dequantizer (llama.cpp's formulas)
must give, bit for bit, the values ``d u + m`` / ``d (u - 8)`` computed here from the intended codes and the
rounded scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.primitives import ZeroPointDomain, code_midpoint
from ..core.qdtype import QKind
from ..layouts.nm_sparse import NMSparseLayout

__all__ = ["GGUFTarget", "TARGETS", "EncodedTensor", "encode_exact", "requantize", "BLOCK"]

BLOCK = 32
_F16_MAX = float(torch.finfo(torch.float16).max)


@dataclass(frozen=True)
class GGUFTarget:
    name: str            # GGML type name
    lo: int              # code range of u
    hi: int
    offset: int          # w = d (u - offset) [+ m]
    has_min: bool
    bytes_per_block: int


TARGETS = (  # fewest bits per weight first
    GGUFTarget("Q4_0", 0, 15, 8, False, 18),
    GGUFTarget("Q4_1", 0, 15, 0, True, 20),
    GGUFTarget("Q5_0", 0, 31, 16, False, 22),
    GGUFTarget("Q5_1", 0, 31, 0, True, 24),
    GGUFTarget("Q8_0", -128, 127, 0, False, 34),
)


@dataclass
class EncodedTensor:
    """One tensor's GGUF bytes ((rows, row bytes) uint8) and what the encoding changed."""
    type_name: str
    data: np.ndarray
    rounded: int          # source scales and mins whose float16 value differs from the source's value
    qparams: int          # source scales and mins (one per source group each)
    max_abs_change: float  # max |w_gguf - w_source| over the tensor, llama.cpp's formula against torchqkit's


def _per_block(t: torch.Tensor, n: int, k: int, block_size) -> torch.Tensor:
    """A (rows / bn, K / bk) qparam -> one value per (row, 32-block): (n, k / 32)."""
    bn, bk = block_size
    rows = torch.arange(n) // bn
    cols = (torch.arange(k // BLOCK) * BLOCK) // bk
    return t[rows][:, cols]


def _layout_problem(w, k: int) -> str | None:
    if w.transposed:
        return "a transposed view (export the module's own weight)"
    if w.qdtype.is_fnuz:
        return (f"{w.qdtype.name} codes (AMD's float8) have no GGUF type (GGUF holds integer "
                f"blocks); pass requantize=True to re-round the weight into one, or keep the fnuz codes in torchqkit's "
                f"own checkpoint (save_quantized / save_pretrained)")
    if w.qdtype.kind is not QKind.INT:
        return f"{w.qdtype.name} codes are not integers on an affine grid; GGUF's integer block types can't hold them"
    if w.input_scale is not None:
        return ("it carries a per-input-channel input_scale (AWQ / SmoothQuant) that GGUF has no place for; fold "
                "it into the preceding norm before quantizing, or pass requantize=True")
    if isinstance(w.qlayout, NMSparseLayout) and w.zero_point_domain is ZeroPointDomain.FLOAT:
        return ("it is N:M sparse with float zero points, where no code means 0.0 (Note [Pruned entries read as "
                "zero]): GGUF's dense blocks can't hold its pruned weights exactly; pass requantize=True")
    if len(w.block_size) != 2:
        return f"a {len(w.block_size)}-d weight (GGUF export takes 2-d Linear / embedding weights)"
    if k % BLOCK:
        return f"K = {k} is not a multiple of {BLOCK}, GGUF's block length"
    bk = w.block_size[1]
    if bk % BLOCK and bk < k:
        return (f"its groups of {bk} along K are not whole {BLOCK}-weight GGUF blocks (group sizes that are multiples "
                f"of {BLOCK}, or one scale per row, map exactly)")
    return None


def _affine_form(w, parts):
    """Per source group: (s, b, shift), w = s q + b; ``shift`` is the integer code that makes b zero (symmetric
    form) or None. s and b are computed in float64 from the stored values, so the float16 rounding is the one that
    counts; shift is int64."""
    s = parts.scale.double()
    zpd = ZeroPointDomain(w.zero_point_domain)
    if zpd is ZeroPointDomain.NONE:
        return s, torch.zeros_like(s), torch.zeros_like(s, dtype=torch.int64)
    z = parts.zero_point
    if zpd is ZeroPointDomain.INT:
        z = z.to(torch.int64)
        return s, -z.double() * s, z
    mid = code_midpoint(w.qdtype)
    zf = z.double()
    shift = torch.full_like(zf, mid, dtype=torch.int64) if bool((zf == 0).all()) else None
    return s, zf - mid * s, shift


def _codes_fit(target: GGUFTarget, q, shift, qmin: int) -> torch.Tensor | None:
    """The codes u the target stores (n, k), or None when some code falls outside its range."""
    if target.has_min:
        u = q - qmin
    else:
        if shift is None:
            return None
        u = q - shift.repeat_interleave(BLOCK, dim=1) + target.offset
    if int(u.min()) < target.lo or int(u.max()) > target.hi:
        return None
    return u


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16)


def _pack(target: GGUFTarget, u: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor | None) -> np.ndarray:
    """Codes u (n, k), d16 / m16 (n, k/32) float16 -> (n, k/32 * bytes_per_block) uint8 in ggml's block order."""
    n, k = u.shape
    nb = k // BLOCK
    u = u.reshape(n, nb, BLOCK)
    head = [d16.reshape(n, nb, 1).view(torch.uint8)]
    if m16 is not None:
        head.append(m16.reshape(n, nb, 1).view(torch.uint8))
    if target.name == "Q8_0":
        body = [u.to(torch.int8).view(torch.uint8)]
    else:
        low = (u & 0xF).to(torch.uint8)
        nibbles = low[..., :16] | (low[..., 16:] << 4)
        body = [nibbles]
        if target.hi == 31:  # qh: bit j of a little-endian uint32 is the 5th bit of element j
            bits = ((u >> 4) & 1).to(torch.int64) << torch.arange(BLOCK)
            qh = bits.sum(-1, keepdim=True).to(torch.int32)       # < 2^32: fits as the same 32 bits
            body.insert(0, qh.view(torch.uint8))
    return torch.cat(head + body, dim=-1).reshape(n, -1).numpy()


def _expected(target: GGUFTarget, u, d16, m16) -> torch.Tensor:
    """llama.cpp's dequantization of the intended blocks, in float32: d (u - offset) [+ m]."""
    n, k = u.shape
    out = d16.float().unsqueeze(-1) * (u - target.offset).float().reshape(n, k // BLOCK, BLOCK)
    if m16 is not None:
        out = out + m16.float().unsqueeze(-1)
    return out.reshape(n, k)


def encode_exact(w, name: str, targets=TARGETS) -> tuple[EncodedTensor | None, str]:
    """The GGUF encoding of an AffineQuantizedTensor ``w`` that keeps its codes, or (None, why there is none). A
    stack of experts (E, N, K) gives data (E, N, row bytes), every expert in one type (Note [GGUF expert tensors]).
    ``targets``: the types to try, fewest bits first."""
    if w.is_experts:
        return _encode_experts(w, name, targets)
    n, k = w.logical_shape[0], w.logical_shape[-1]
    problem = _layout_problem(w, k)
    if problem is not None:
        return None, problem
    parts = w.qlayout.unpack(w)
    parts = type(parts)(*(None if t is None else t.cpu() for t in parts))  # the file's bytes are built on the host
    q = parts.qdata.to(torch.int64)
    s_g, b_g, shift_g = _affine_form(w, parts)
    shift = None if shift_g is None else _per_block(shift_g, n, k, w.block_size)
    for target in targets:
        u = _codes_fit(target, q, shift, int(w.qdtype.qmin))
        if u is None:
            continue
        m_g = b_g + s_g * int(w.qdtype.qmin) if target.has_min else None
        for what, v in (("scale", s_g), ("min", m_g)):
            if v is None:
                continue
            if not bool(torch.isfinite(v).all()):
                return None, f"its block {what}s hold NaN or Inf"
            if bool((v.abs() > _F16_MAX).any()):
                return None, (f"a block {what} of {float(v.abs().max()):.4g} is beyond float16's range (GGUF stores "
                              f"{target.name}'s {what}s as float16)")
        d16_g, m16_g = _f16(s_g), None if m_g is None else _f16(m_g)
        rounded = int((d16_g.double() != s_g).sum()) + (0 if m_g is None else int((m16_g.double() != m_g).sum()))
        d16 = _per_block(d16_g, n, k, w.block_size)
        m16 = None if m16_g is None else _per_block(m16_g, n, k, w.block_size)
        data = _pack(target, u, d16, m16)
        got = _expected(target, u, d16, m16)
        _check_bytes(target, data, got, name)
        change = float((got - w.dequantize(torch.float32).cpu()).abs().max()) if got.numel() else 0.0
        return EncodedTensor(target.name, data, rounded, s_g.numel() * (1 if m_g is None else 2), change), ""
    return None, _no_fit_reason(w, shift)


def _encode_experts(w, name: str, targets) -> tuple[EncodedTensor | None, str]:
    """Each expert with the 2-d encoder; a GGUF tensor has one type, so when experts pick different types all are
    encoded again from the widest one picked (every later type holds more codes; one that can't hold some expert
    ends the search with that expert's reason)."""
    from ..tensor.experts import expert_view
    if w.transposed:
        return None, "a transposed expert stack (GGUF holds (E, N, K) experts)"
    start = 0
    while True:
        encoded = []
        for e in range(w.logical_shape[0]):
            enc, why = encode_exact(expert_view(w, e), f"{name}[{e}]", targets[start:])
            if enc is None:
                return None, f"expert {e}: {why}"
            encoded.append(enc)
        picked = {targets.index(next(t for t in targets if t.name == enc.type_name)) for enc in encoded}
        if len(picked) == 1:
            return EncodedTensor(encoded[0].type_name, np.stack([enc.data for enc in encoded]),
                                 sum(enc.rounded for enc in encoded), sum(enc.qparams for enc in encoded),
                                 max(enc.max_abs_change for enc in encoded)), ""
        start = max(picked)


def _no_fit_reason(w, shift) -> str:
    asym = "" if shift is not None else " (a non-zero float zero point needs a type with a min: Q4_1 / Q5_1)"
    return (f"its {w.qdtype.name} codes span more than 32 values{asym}; no GGUF block type holds them exactly "
            f"(Q4_1 / Q5_1 take up to 16 / 32 code values with a zero point, Q8_0 signed 8-bit codes without one)")


def _check_bytes(target, data, want: torch.Tensor, name) -> None:
    """gguf-py's dequantizer on the bytes must equal the intended values bit for bit (an encoder self-check)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    got = dequantize(data, GGMLQuantizationType[target.name]).reshape(want.shape)
    want = want.numpy()
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        bad = int((got.view(np.uint32) != want.view(np.uint32)).sum())
        raise RuntimeError(f"torchqkit.save_gguf: internal error: {name}'s {target.name} bytes dequantize to "
                           f"{bad} value(s) other than intended; please report this")


def requantize(value: torch.Tensor, bits: int, asymmetric: bool) -> tuple[str, np.ndarray]:
    """A float weight (n, k), k a multiple of 32, re-rounded by gguf-py to the legacy type nearest to ``bits``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    if bits <= 4:
        name = "Q4_1" if asymmetric else "Q4_0"
    elif bits == 5:
        name = "Q5_1" if asymmetric else "Q5_0"
    else:
        name = "Q8_0"
    data = quantize(value.detach().float().cpu().contiguous().numpy(), GGMLQuantizationType[name])
    return name, data
