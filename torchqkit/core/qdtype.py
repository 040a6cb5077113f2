"""Quantized dtypes: what a code means, independent of how a layout stores it.

A QDType names a format (``int4``, ``nf4``, ``float8_e4m3fn`` ...) and knows its code range and the
torch dtype that holds one unpacked code. Layouts decide how codes are packed; the primitives in
``primitives.py`` decide how floats become codes and back.

Example:
    ```python
    import torchqkit as qk
    q = qk.qdtypes.qdtype_from_name("int4")        # also qk.qdtypes.int4
    print(q.qmin, q.qmax, q.kind)                   # -8 7 QKind.INT
    print([q.name for q in qk.qdtypes.all_qdtypes()])
    ```
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

__all__ = ["QDType", "QKind", "qdtype_from_name", "all_qdtypes"]


class QKind(str, Enum):
    """The family of a quantized dtype, which fixes how codes map to values.

    Attributes:
        INT: affine integer codes, signed or unsigned (``int1`` .. ``int8``, ``uint1`` .. ``uint8``).
        FLOAT8: IEEE-like 8-bit floats stored in torch's float8 dtypes (``float8_e4m3fn``, ``float8_e5m2``, and
            AMD's ``float8_e4m3fnuz``, ``float8_e5m2fnuz``: Note [float8 fnuz]).
        CODEBOOK: an index into a fixed table of levels (``nf4``, ``fp4_e2m1``: 16 levels; ``fp6_e3m2``,
            ``fp6_e2m3``: 64).
        FLOAT: the values themselves in a torch float dtype (``float32``, ``bfloat16``, ``float16``): scale 1, no
            rounding. Only a layout that compresses by other means stores it (``NMSparseLayout`` keeps the float
            values of a pruned weight that is not quantized).

    Example:
        ```python
        import torchqkit as qk
        assert qk.qdtypes.nf4.kind is qk.qdtypes.QKind.CODEBOOK
        ints = [q.name for q in qk.qdtypes.all_qdtypes() if q.kind is qk.qdtypes.QKind.INT]
        ```
    """
    INT = "int"          # affine integer codes, signed or unsigned
    FLOAT8 = "float8"    # IEEE-like 8-bit floats, stored in torch's float8 dtypes
    CODEBOOK = "codebook"  # index into a fixed table of levels (nf4, fp4_e2m1: 16; fp6: 64)
    FLOAT = "float"      # the float values themselves (scale 1): Note [Float identity codes]


@dataclass(frozen=True)
class QDType:
    """A quantized dtype: what a code means, independent of how a layout stores it.

    The registered instances are module attributes of ``torchqkit.qdtypes`` (``int1`` .. ``int8``, ``uint1`` ..
    ``uint8``, ``float8_e4m3fn``, ``float8_e5m2``, ``float8_e4m3fnuz``, ``float8_e5m2fnuz``, ``nf4``, ``fp4_e2m1``,
    ``fp6_e3m2``, ``fp6_e2m3``, and the identity formats ``float32``, ``bfloat16``, ``float16``); configs and the
    primitives take them (or their names). ``is_fnuz`` tells AMD's float8 formats (Note [float8 fnuz]) apart.
    Instances are frozen, compare by value, print as ``torchqkit.<name>`` and pickle by name.
    Building a new one does not register it: ``qdtype_from_name`` knows only the registered ones.

    Args:
        name (str): the format's name, e.g. ``"int4"``.
        bits (int): bits per code.
        kind (QKind): ``QKind.INT``, ``QKind.FLOAT8``, ``QKind.CODEBOOK`` or ``QKind.FLOAT``.
        signed (bool): whether codes (or values) are signed.
        qmin (float): the smallest code (INT), index (CODEBOOK: 0) or finite value (FLOAT8: -max).
        qmax (float): the largest code (INT), index (CODEBOOK: 15, fp6: 63) or finite value (FLOAT8: max).
        storage_dtype (torch.dtype): the torch dtype holding one unpacked code (``torch.int8``, ``torch.uint8``,
            a float8 dtype, or for ``QKind.FLOAT`` the float dtype itself).
        levels (tuple[float, ...]): CODEBOOK only: the value of each code, indexed by code; default ``()``.

    Example:
        ```python
        import torch
        import torchqkit as qk
        q = qk.qdtypes.int4
        assert (q.qmin, q.qmax, q.storage_dtype) == (-8, 7, torch.int8)
        print(qk.qdtypes.nf4.max_abs_level, qk.qdtypes.float8_e4m3fn.qmax)   # 1.0 448.0
        assert qk.qdtypes.float8_e4m3fnuz.qmax == 240.0 and qk.qdtypes.float8_e4m3fnuz.is_fnuz
        ```
    """
    name: str
    bits: int
    kind: QKind
    signed: bool
    # Integer range of a code (for CODEBOOK: index range 0..15 or 0..63; for FLOAT8: +-max finite value).
    qmin: float
    qmax: float
    # dtype holding one unpacked code.
    storage_dtype: torch.dtype
    # CODEBOOK only: level value of each code, indexed by code.
    levels: tuple[float, ...] = field(default=(), repr=False)

    @property
    def is_integer(self) -> bool:
        return self.kind is QKind.INT

    @property
    def is_fnuz(self) -> bool:
        """AMD's float8 formats (``float8_e4m3fnuz``, ``float8_e5m2fnuz``): Note [float8 fnuz]."""
        return self.storage_dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

    @property
    def max_abs_level(self) -> float:
        """Largest magnitude a code represents (before scaling)."""
        if self.kind is QKind.CODEBOOK:
            return max(abs(v) for v in self.levels)
        return max(abs(self.qmin), abs(self.qmax))

    def __repr__(self) -> str:
        return f"torchqkit.{self.name}"

    def __reduce__(self):
        # Pickle by name, so checkpoints hold a string, not the object's fields.
        return (qdtype_from_name, (self.name,))


_REGISTRY: dict[str, QDType] = {}


def _register(q: QDType) -> QDType:
    _REGISTRY[q.name] = q
    return q


def _int(bits: int) -> QDType:
    return _register(QDType(f"int{bits}", bits, QKind.INT, True, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, torch.int8))


def _uint(bits: int) -> QDType:
    return _register(QDType(f"uint{bits}", bits, QKind.INT, False, 0, 2 ** bits - 1, torch.uint8))


INT = {b: _int(b) for b in range(1, 9)}
UINT = {b: _uint(b) for b in range(1, 9)}

float8_e4m3fn = _register(
    QDType("float8_e4m3fn", 8, QKind.FLOAT8, True, torch.finfo(torch.float8_e4m3fn).min,
           torch.finfo(torch.float8_e4m3fn).max, torch.float8_e4m3fn))
float8_e5m2 = _register(
    QDType("float8_e5m2", 8, QKind.FLOAT8, True, torch.finfo(torch.float8_e5m2).min,
           torch.finfo(torch.float8_e5m2).max, torch.float8_e5m2))

# Note [float8 fnuz]
# ~~~~~~~~~~~~~~~~~~
# AMD's float8 formats (the MI300 generation's float8 hardware; torch.float8_e4m3fnuz / torch.float8_e5m2fnuz): the
# OCP formats' bit fields with an exponent bias one larger (e4m3fnuz: 8, e5m2fnuz: 16), no infinities and no negative
# zero: 0x80 is the only NaN. So every other byte's value is half the OCP value of the same bits (e4m3fn's NaN codes
# 0x7F / 0xFF are +-240, e5m2's exponent 31 is finite), largest 240 / 57344, smallest subnormal 2^-10 / 2^-17.
# Quantizing saturates at that max before the cast (torch's cast of anything past it is NaN, not the max) and
# rounds to nearest even; a value that rounds to zero is +0, never the NaN byte. Everything that takes a float8
# qdtype takes these (the oracle, Float8Layout and its kernels, checkpoints); an exporter whose format has no fnuz
# (GGUF, compressed-tensors, MX) refuses them by name.
float8_e4m3fnuz = _register(
    QDType("float8_e4m3fnuz", 8, QKind.FLOAT8, True, torch.finfo(torch.float8_e4m3fnuz).min,
           torch.finfo(torch.float8_e4m3fnuz).max, torch.float8_e4m3fnuz))
float8_e5m2fnuz = _register(
    QDType("float8_e5m2fnuz", 8, QKind.FLOAT8, True, torch.finfo(torch.float8_e5m2fnuz).min,
           torch.finfo(torch.float8_e5m2fnuz).max, torch.float8_e5m2fnuz))

# Note [NF4 levels]: the 16 NormalFloat levels of QLoRA (Dettmers et al., 2023, appendix E),
# quantiles of N(0, 1) normalised to [-1, 1] with an exact zero. Code i means levels[i].
_NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
nf4 = _register(QDType("nf4", 4, QKind.CODEBOOK, True, 0, 15, torch.uint8, _NF4_LEVELS))

# FP4 E2M1 (OCP microscaling spec): code = sign bit (bit 3) | exponent (bits 2..1) | mantissa (bit 0).
# Codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same values negated (8 is -0).
_FP4_POS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
fp4_e2m1 = _register(QDType("fp4_e2m1", 4, QKind.CODEBOOK, True, 0, 15, torch.uint8,
                            _FP4_POS + tuple(-v for v in _FP4_POS)))



def _fp6_levels(ebits: int) -> tuple[float, ...]:
    """The 64 values of an OCP MX FP6 format (no inf / NaN), indexed by code: see Note [FP6 codes]."""
    mbits, bias = 5 - ebits, 2 ** (ebits - 1) - 1
    pos = []
    for mag in range(32):
        e, m = mag >> mbits, mag & ((1 << mbits) - 1)
        pos.append(m / 2 ** mbits * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2 ** mbits) * 2.0 ** (e - bias))
    return tuple(pos) + tuple(-v for v in pos)


# Note [FP6 codes]
# ~~~~~~~~~~~~~~~~
# FP6 E3M2 and E2M3 (OCP Microscaling spec v1.0, section 5.3.2): code = sign (bit 5) | exponent | mantissa, no
# inf or NaN. E3M2: exponent bias 3, 2 mantissa bits, largest 28.0 (0b011111), smallest subnormal 0.0625.
# E2M3: bias 1, 3 mantissa bits, largest 7.5, smallest subnormal 0.125. Exponent 0 is subnormal: m / 2^M * 2^(1 - bias).
# Codes 32..63 are codes 0..31 negated (32 is -0). FP6Layout packs four codes in three bytes (layouts/fp6.py).
fp6_e3m2 = _register(QDType("fp6_e3m2", 6, QKind.CODEBOOK, True, 0, 63, torch.uint8, _fp6_levels(3)))
fp6_e2m3 = _register(QDType("fp6_e2m3", 6, QKind.CODEBOOK, True, 0, 63, torch.uint8, _fp6_levels(2)))

# Note [Float identity codes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A pruned weight that is not quantized (SparsityConfig(base=None)) still goes through the affine machinery, so that
# one AffineQuantizedTensor, one dequantize and one checkpoint format serve it: its "codes" are its float values in
# their own dtype, with scale 1 and no zero point. choose_qparams_affine gives scale 1, quantize_affine casts and
# dequantize_affine multiplies by 1: exact for values already in that dtype. Only NMSparseLayout stores them.
FLOAT = {name: _register(QDType(name, torch.finfo(dtype).bits, QKind.FLOAT, True, torch.finfo(dtype).min,
                                torch.finfo(dtype).max, dtype))
         for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16))}


def float_qdtype(dtype: torch.dtype) -> QDType:
    """The identity qdtype (Note [Float identity codes]) of a float dtype; ValueError for any other dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in FLOAT:
        raise ValueError(f"no identity qdtype for {dtype}: weights kept as values must be float32, bfloat16 or float16")
    return FLOAT[name]


globals().update({f"int{b}": q for b, q in INT.items()})
globals().update({f"uint{b}": q for b, q in UINT.items()})
globals().update(FLOAT)
__all__ += list(_REGISTRY)


def qdtype_from_name(name: str) -> QDType:
    """The registered quantized dtype called ``name``.

    Configs use it to accept a qdtype's name wherever they take a ``QDType``, and pickles of a ``QDType`` are
    rebuilt with it.

    Args:
        name (str): a registered name: ``"int1"`` .. ``"int8"``, ``"uint1"`` .. ``"uint8"``, ``"float8_e4m3fn"``,
            ``"float8_e5m2"``, ``"float8_e4m3fnuz"``, ``"float8_e5m2fnuz"``, ``"nf4"``, ``"fp4_e2m1"``, ``"fp6_e3m2"``,
            ``"fp6_e2m3"``, or an identity format ``"float32"``, ``"bfloat16"``, ``"float16"``.

    Returns:
        QDType: the registered instance (the same object each call).

    Raises:
        ValueError: an unknown name (the message lists the known ones).

    Example:
        ```python
        import torchqkit as qk
        assert qk.qdtypes.qdtype_from_name("uint4") is qk.qdtypes.uint4
        ```
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown qdtype {name!r}; known qdtypes: {sorted(_REGISTRY)}") from None


def all_qdtypes() -> list[QDType]:
    """Every registered quantized dtype, in registration order.

    Returns:
        list[QDType]: int1..int8, uint1..uint8, float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, nf4,
        fp4_e2m1, fp6_e3m2, fp6_e2m3 and the identity formats float32, bfloat16, float16.

    Example:
        ```python
        import torchqkit as qk
        names = [q.name for q in qk.qdtypes.all_qdtypes()]
        assert "nf4" in names and "float8_e4m3fn" in names
        ```
    """
    return list(_REGISTRY.values())
