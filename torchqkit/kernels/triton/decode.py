"""Element decoders shared by the Triton kernels: bytes as the layouts store them -> float32.

Built from bits (no lookup tables, no float8 loads), so they run the same in the interpreter, on every
GPU family, and agree bit for bit with csrc/common/dequant.h.
"""
import torch
import triton
import triton.language as tl

from ...core.qdtype import nf4

# The float8 flavours float8_to_f32 decodes, as its compile-time FMT argument (the fnuz ones: Note [float8 fnuz] in
# core/qdtype.py).
F8_E4M3FN, F8_E5M2, F8_E4M3FNUZ, F8_E5M2FNUZ = 0, 1, 2, 3
FLOAT8_FORMATS = {torch.float8_e4m3fn: F8_E4M3FN, torch.float8_e5m2: F8_E5M2, torch.float8_e4m3fnuz: F8_E4M3FNUZ,
                  torch.float8_e5m2fnuz: F8_E5M2FNUZ}

# The NF4 levels of core/qdtype.py as compile-time constants of the select tree below (one table in Python).
_L0, _L1, _L2, _L3, _L4, _L5, _L6, _L7, _L8, _L9, _L10, _L11, _L12, _L13, _L14, _L15 = (
    tl.constexpr(float(v)) for v in nf4.levels)


@triton.jit
def e4m3fn_to_f32(b):
    """float8_e4m3fn byte (int32 0..255): sign | 4 exponent bits (bias 7) | 3 mantissa bits. NaN not produced."""
    sign = (b & 0x80) << 24
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = (sign | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # exp == 0: man * 2^-9
    return tl.where(exp == 0, tl.where(sign != 0, -sub, sub), normal)


@triton.jit
def e5m2_to_f32(b):
    """float8_e5m2 byte: the top byte of an IEEE fp16, so the value is exact in fp16."""
    return (b << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3fnuz_to_f32(b):
    """float8_e4m3fnuz byte: sign | 4 exponent bits (bias 8) | 3 mantissa bits, subnormals man * 2^-10; 0x80 is the
    only NaN (and produced: its bits would otherwise read as -0)."""
    sign = (b & 0x80) << 24
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = (sign | ((exp + 119) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.0009765625  # exp == 0: man * 2^-10
    value = tl.where(exp == 0, tl.where(sign != 0, -sub, sub), normal)
    return tl.where(b == 0x80, float("nan"), value)


@triton.jit
def e5m2fnuz_to_f32(b):
    """float8_e5m2fnuz byte: sign | 5 exponent bits (bias 16, 31 finite) | 2 mantissa bits, subnormals man * 2^-17;
    0x80 is the only NaN."""
    sign = (b & 0x80) << 24
    exp = (b >> 2) & 0x1F
    man = b & 0x3
    normal = (sign | ((exp + 111) << 23) | (man << 21)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.00000762939453125  # exp == 0: man * 2^-17
    value = tl.where(exp == 0, tl.where(sign != 0, -sub, sub), normal)
    return tl.where(b == 0x80, float("nan"), value)


@triton.jit
def float8_to_f32(b, FMT: tl.constexpr):
    """A float8 byte of the flavour FMT (F8_E4M3FN, F8_E5M2, F8_E4M3FNUZ or F8_E5M2FNUZ), chosen at compile time."""
    if FMT == 1:  # F8_E5M2 (jit code reads only constexpr globals)
        return e5m2_to_f32(b)
    elif FMT == 2:  # F8_E4M3FNUZ
        return e4m3fnuz_to_f32(b)
    elif FMT == 3:  # F8_E5M2FNUZ
        return e5m2fnuz_to_f32(b)
    else:
        return e4m3fn_to_f32(b)


@triton.jit
def e2m1_to_f32(c):
    """fp4 e2m1 code (0..15): sign (bit 3) | exponent (bits 2..1, bias 1) | mantissa (bit 0)."""
    exp = (c >> 1) & 0x3
    man = c & 0x1
    normal = (((exp + 126) << 23) | (man << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.5, normal)
    return tl.where((c & 0x8) != 0, -mag, mag)


@triton.jit
def nf4_level(code):
    """NF4 code (0..15) -> its level (core/qdtype.py's table, as float32 constants) by a select tree on the
    bits: no table tensor to pass or to cache (a cached device tensor would be a constant under torch.compile)."""
    b0 = (code & 1) != 0
    b1 = (code & 2) != 0
    b2 = (code & 4) != 0
    p0 = tl.where(b0, _L1, _L0)
    p1 = tl.where(b0, _L3, _L2)
    p2 = tl.where(b0, _L5, _L4)
    p3 = tl.where(b0, _L7, _L6)
    p4 = tl.where(b0, _L9, _L8)
    p5 = tl.where(b0, _L11, _L10)
    p6 = tl.where(b0, _L13, _L12)
    p7 = tl.where(b0, _L15, _L14)
    r0 = tl.where(b2, tl.where(b1, p3, p2), tl.where(b1, p1, p0))
    r1 = tl.where(b2, tl.where(b1, p7, p6), tl.where(b1, p5, p4))
    return tl.where((code & 8) != 0, r1, r0)


@triton.jit
def e8m0_to_f32(e):
    """E8M0 scale byte: 2^(e - 127); e = 0 is the float32 subnormal 2^-127."""
    return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def int4_tiled_tile(q_ptr, sz_ptr, rn, kk, N, K, GROUP, NUM_CHUNKS, WORDS, N8):
    """(len(kk), len(rn)) float32 TensorCoreTiledLayout weights, zero outside (K, N). For (n, k), n = 8 i + r,
    k = 16 T j + 16 t + 8 h + 2 c + e: nibble 4 e + 2 (t % 2) + h of word t // 2, lane 4 r + c, tile (i, j)."""
    chunk = 32 * WORDS                      # 16 T k values per chunk
    rem = kk % chunk
    t = rem // 16
    lane = 4 * (rn % 8)[None, :] + ((rem % 8) // 2)[:, None]
    word_idx = (((rn // 8)[None, :] * NUM_CHUNKS + (kk // chunk)[:, None]) * 32 + lane) * WORDS + (t // 2)[:, None]
    shift = 4 * (4 * (rem % 2) + 2 * (t % 2) + (rem % 16) // 8)
    mask = (kk < K)[:, None] & (rn < N)[None, :]
    words = tl.load(q_ptr + word_idx, mask=mask, other=0)
    q = (words >> shift[:, None]) & 0xF     # arithmetic shift, the mask drops the sign
    sz = sz_ptr + ((kk // GROUP)[:, None] * N8 + rn[None, :]) * 2
    scale = tl.load(sz, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(sz + 1, mask=mask, other=0.0).to(tl.float32)
    return (q.to(tl.float32) - 8.0) * scale + zero


@triton.jit
def packed_field(row_ptr, j, BITS: tl.constexpr, row_bytes, mask):
    """Field j (int32) of the stream of BITS-bit fields starting at ``row_ptr`` (Note [Packed intx bits]): stream bit
    s is bit s % 8 of byte s // 8. Widths that divide 8 never cross a byte; others also read the next byte, never
    one at or past ``row_bytes``."""
    bit = j * BITS
    byte = bit // 8
    word = tl.load(row_ptr + byte, mask=mask, other=0).to(tl.int32)
    if 8 % BITS != 0:
        nxt = tl.load(row_ptr + byte + 1, mask=mask & (byte + 1 < row_bytes), other=0).to(tl.int32)
        word = word | (nxt << 8)
    return (word >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit
def affine_value(code, s, z, DOMAIN: tl.constexpr, MID: tl.constexpr):
    """core/primitives.dequantize_affine of float32 codes, in its order of operations: c s (DOMAIN 0, no zero point),
    (c - z) s (1, integer domain) or (c - MID) s + z (2, float domain; MID the code midpoint)."""
    if DOMAIN == 1:
        w = (code - z) * s
    elif DOMAIN == 2:
        w = (code - MID) * s + z
    else:
        w = code * s
    return w
