// Bit unpacking and dequantization of torchqkit's packed layouts, shared by the CPU and CUDA kernels.
//
// Every function is `__host__ __device__` under nvcc and a plain inline function under a C++ compiler,
// header-only, no torch and no CUDA headers. The layouts' docstrings define the bytes (layouts/*.py):
//   TensorCoreTiledLayout  Note [Tensor-core tiled int4]  int32 words, nibble 4e + 2u + h
//   NF4Layout              Note [NF4 bit layout]           high nibble = even k
//   MXLayout               Note [MX bit layout]            low nibble = even k (fp4), E8M0 scales
//   Float8Layout           float8_e4m3fn / float8_e5m2 / float8_e4m3fnuz / float8_e5m2fnuz bytes
// Unit-tested on CPU against the Python references (test/kernels/cuda/test_common_helpers.py compiles
// csrc/common/dequant_selftest.cpp with the host compiler).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TQK_HD __host__ __device__ __forceinline__
#else
#define TQK_HD inline
#endif

// The codebooks, written once for every C++ and CUDA kernel (the Python oracle's tables are in core/qdtype.py;
// test/kernels/cuda/test_common_helpers.py checks these against them bit for bit).
// The 16 NormalFloat levels, code 0..15, as the float32 values torch.tensor(nf4.levels) holds.
#define TORCHQKIT_NF4_LEVELS                                                                              \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,       \
      -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,     \
      0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,              \
      0.7229568362236023f, 1.0f
// OCP fp4 e2m1 values, code 0..15: sign bit 3.
#define TORCHQKIT_FP4_E2M1_LEVELS \
  0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f

namespace torchqkit_common {

TQK_HD float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// ---- float8 / fp4 / E8M0 elements, built from bits (exact) ----

// e4m3fn: sign | 4 exponent bits (bias 7) | 3 mantissa bits; exponent 0 is subnormal (m * 2^-9);
// 0x7F / 0xFF are NaN (returned as NaN).
TQK_HD float fp8_e4m3fn_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xF, man = b & 0x7;
  if (exp == 0xF && man == 0x7) return float_from_bits(0x7FC00000u | sign);
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 0.001953125f;
    return sign ? -mag : mag;
  }
  return float_from_bits(sign | ((exp + 120) << 23) | (man << 20));
}

// e5m2: the top byte of an IEEE half (inf and NaN included).
TQK_HD float fp8_e5m2_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t exp = (b >> 2) & 0x1F, man = b & 0x3;
  if (exp == 0x1F) return float_from_bits(sign | 0x7F800000u | (man << 21));
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 0.0000152587890625f;  // m * 2^-16
    return sign ? -mag : mag;
  }
  return float_from_bits(sign | ((exp + 112) << 23) | (man << 21));
}

// e4m3fnuz (AMD's, Note [float8 fnuz] in torchqkit/core/qdtype.py): sign | 4 exponent bits (bias 8) | 3 mantissa
// bits; exponent 0 is subnormal (m * 2^-10); no inf, no negative zero: 0x80 is the only NaN, 0x7F / 0xFF are +-240.
TQK_HD float fp8_e4m3fnuz_to_float(uint8_t b) {
  if (b == 0x80) return float_from_bits(0x7FC00000u);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xF, man = b & 0x7;
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 0.0009765625f;  // m * 2^-10
    return sign ? -mag : mag;
  }
  return float_from_bits(sign | ((exp + 119) << 23) | (man << 20));
}

// e5m2fnuz: sign | 5 exponent bits (bias 16) | 2 mantissa bits; exponent 0 is subnormal (m * 2^-17); no inf, no
// negative zero: 0x80 is the only NaN, exponent 31 is finite (up to +-57344).
TQK_HD float fp8_e5m2fnuz_to_float(uint8_t b) {
  if (b == 0x80) return float_from_bits(0x7FC00000u);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t exp = (b >> 2) & 0x1F, man = b & 0x3;
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 0.00000762939453125f;  // m * 2^-17
    return sign ? -mag : mag;
  }
  return float_from_bits(sign | ((exp + 111) << 23) | (man << 21));
}

// fp4 e2m1 code (0..15): sign (bit 3) | exponent (bits 2..1, bias 1) | mantissa (bit 0).
TQK_HD float fp4_e2m1_to_float(uint8_t c) {
  const uint32_t exp = (c >> 1) & 0x3, man = c & 0x1;
  const float mag = exp == 0 ? 0.5f * static_cast<float>(man) : float_from_bits(((exp + 126) << 23) | (man << 22));
  return (c & 0x8) ? -mag : mag;
}

// E8M0 scale: 2^(e - 127); e = 0 is the float32 subnormal 2^-127, e = 255 NaN.
TQK_HD float e8m0_to_float(uint8_t e) {
  if (e == 255) return float_from_bits(0x7FC00000u);
  return float_from_bits(e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23);
}

// ---- NF4 ----

// The 16 NormalFloat levels (core/qdtype.py), as the float32 values torch.tensor(nf4.levels) holds.
// A select tree over the code's bits rather than a table lookup: a dynamically indexed local array lives in
// local memory on the GPU (ptxas reported a 160-byte stack frame and spills); these selects stay in registers.
TQK_HD float nf4_level(int code) {
  constexpr float L[16] = {TORCHQKIT_NF4_LEVELS};
  const bool b0 = code & 1, b1 = code & 2, b2 = code & 4, b3 = code & 8;
  const float p0 = b0 ? L[1] : L[0], p1 = b0 ? L[3] : L[2], p2 = b0 ? L[5] : L[4], p3 = b0 ? L[7] : L[6];
  const float p4 = b0 ? L[9] : L[8], p5 = b0 ? L[11] : L[10], p6 = b0 ? L[13] : L[12], p7 = b0 ? L[15] : L[14];
  const float q0 = b1 ? p1 : p0, q1 = b1 ? p3 : p2, q2 = b1 ? p5 : p4, q3 = b1 ? p7 : p6;
  const float r0 = b2 ? q1 : q0, r1 = b2 ? q3 : q2;
  return b3 ? r1 : r0;
}

// Code of element k in a row of NF4 bytes: byte k / 2, high nibble for even k.
TQK_HD int nf4_code(const uint8_t* row, int64_t k) {
  const uint8_t b = row[k >> 1];
  return (k & 1) ? (b & 0xF) : (b >> 4);
}

// Double quantization (Note [NF4 double quantization]): absmax = code * scale[flat / 256] + offset.
constexpr int kNf4DqGroup = 256;
TQK_HD float nf4_dq_absmax(int8_t code, float group_scale, float offset) {
  return static_cast<float>(code) * group_scale + offset;
}

// ---- MX ----

// Code of element k in a row of MXFP4 bytes: byte k / 2, LOW nibble for even k.
TQK_HD int mxfp4_code(const uint8_t* row, int64_t k) {
  const uint8_t b = row[k >> 1];
  return (k & 1) ? (b >> 4) : (b & 0xF);
}

// ---- tensor-core tiled int4 (Note [Tensor-core tiled int4]) ----
//
// qdata: int32 [N8 / 8][num_chunks][32][words], words = T / 2, a chunk covers 16 T = 32 words k values.
// Element (n, k), n = 8 i + r, k = 16 T j + 16 t + 8 h + 2 c + e, is nibble 4 e + 2 (t % 2) + h of word
// t / 2 of lane 4 r + c in tile (i, j).
struct Int4TiledPos {
  int64_t word;  // index into the flat int32 array
  int shift;     // bit offset of the nibble
};

TQK_HD Int4TiledPos int4_tiled_pos(int64_t n, int64_t k, int64_t num_chunks, int words) {
  const int64_t chunk = 32 * static_cast<int64_t>(words);
  const int64_t rem = k % chunk;
  const int t = static_cast<int>(rem / 16), h = static_cast<int>((rem % 16) / 8);
  const int c = static_cast<int>((rem % 8) / 2), e = static_cast<int>(rem % 2);
  const int lane = 4 * static_cast<int>(n % 8) + c;
  const int64_t word = (((n / 8) * num_chunks + k / chunk) * 32 + lane) * words + t / 2;
  return {word, 4 * (4 * e + 2 * (t % 2) + h)};
}

TQK_HD int int4_tiled_code(const int32_t* q, int64_t n, int64_t k, int64_t num_chunks, int words) {
  const Int4TiledPos p = int4_tiled_pos(n, k, num_chunks, words);
  return static_cast<int>((static_cast<uint32_t>(q[p.word]) >> p.shift) & 0xFu);
}

// The mma fragment view of one word: (word >> 4 s) & 0x000F000F holds, in its two 16-bit halves, the codes
// of k = 2c + 8 (s & 1) + {0, 1} of k16-tile 2 w + (s >> 1): s = 0 / 1 are b0b1 / b2b3 of tile 2w,
// s = 2 / 3 those of tile 2w + 1.
TQK_HD uint32_t int4_tiled_pair(uint32_t word, int s) { return (word >> (4 * s)) & 0x000F000Fu; }

// Index of the int32 word that holds lane `lane`'s B fragment of k16-tile t (0 .. 2 words - 1) of k-chunk j in
// n-tile i: the one 32-bit load per lane and k16-tile of the mma kernel (csrc/cuda/int4_tiled_mma.cu).
TQK_HD int64_t int4_tiled_lane_word(int64_t i, int64_t j, int lane, int t, int64_t num_chunks, int words) {
  return ((i * num_chunks + j) * 32 + lane) * words + t / 2;
}

// ---- mma.sync.m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16" with .f16 / .bf16) ----
// groupID g = lane / 4, threadID_in_group c = lane % 4. Element i of a lane's fragment sits at:
//   A (16 x 16, row-major), i = 0..7 (register i / 2, half i % 2): row g (+8 if i & 2), col 2c + (i & 1) (+8 if i & 4)
//   B (16 x 8, "col": k x n),  i = 0..3:                            k 2c + (i & 1) (+8 if i & 2),  n g
//   C (16 x 8, fp32),          i = 0..3:                            row g (+8 if i & 2),           col 2c + (i & 1)
struct MmaCoord {
  int row;  // A, C: row (m); B: k
  int col;  // A: k; B, C: column (n)
};
TQK_HD MmaCoord mma_a_coord(int lane, int i) {
  return {lane / 4 + ((i & 2) ? 8 : 0), 2 * (lane % 4) + (i & 1) + ((i & 4) ? 8 : 0)};
}
TQK_HD MmaCoord mma_b_coord(int lane, int i) { return {2 * (lane % 4) + (i & 1) + ((i & 2) ? 8 : 0), lane / 4}; }
TQK_HD MmaCoord mma_c_coord(int lane, int i) { return {lane / 4 + ((i & 2) ? 8 : 0), 2 * (lane % 4) + (i & 1)}; }

// w = (q - 8) * scale + zero (uint4 with a float-domain zero point).
TQK_HD float int4_dequant(int code, float scale, float zero) {
  return static_cast<float>(code - 8) * scale + zero;
}

}  // namespace torchqkit_common
