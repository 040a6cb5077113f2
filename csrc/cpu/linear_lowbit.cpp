// Low-bit weight-only linear kernels for x86 (scalar, AVX2 + FMA + F16C, AVX-512 F/BW/VL/DQ): NF4 (single
// and double quantized), float8 e4m3fn / e5m2, packed intx (1..7 bits). They read the layouts' bytes as
// stored (device-independent, no repacking); the bit layouts are documented in torchqkit/layouts/nf4.py,
// float8.py and packed_intx.py.
//
// No torch header here (see kernels.h). Each ISA level is a `#pragma GCC target` region, as in
// linear_int8.cpp, so the scalar code runs on any x86-64 CPU.
//
// See Note [Low-bit decode]: every format turns one "chunk" of 16 consecutive weights of a row (which starts
// on a byte: 16 codes are 8 bytes of nf4, 16 of float8, 2 * bits of intx) into 16 fp32 levels; the scale
// (and offset) of the chunk's group turns them into weights. Rows start on a byte boundary in every
// layout, so chunk c of a row starts at byte c * kChunkBytes. The last chunk of a row (K % 16 != 0) is
// copied into a zeroed stack buffer first, so no load reads past the row; the glue pads x with zero
// columns up to a multiple of 16, so those lanes add nothing.
//
//   * dot kernel (decode, small M): 4 weight rows x up to 4 tokens per tile; the weights are decoded in
//     registers and each byte is read from memory once per tile of tokens (bandwidth-bound at M = 1).
//   * prefill (larger M): a block of rows x columns decoded to fp32 once into a per-thread L2 buffer, then
//     the same dot tiles (4 tokens x 4 rows, x tile in L1) over it: one decode per weight, FMA-bound.
#include "../common/dequant.h"
#include "avx2_reduce.h"
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace torchqkit_cpu {
namespace {

// The codebooks of csrc/common/dequant.h as aligned tables: code i -> kNf4[i] / kFp4[i] (one zmm / two ymm loads).
alignas(64) constexpr float kNf4[16] = {TORCHQKIT_NF4_LEVELS};
alignas(64) constexpr float kFp4[16] = {TORCHQKIT_FP4_E2M1_LEVELS};

int64_t row_bytes(const LowbitArgs& p) {
  switch (p.fmt) {
    case LowbitFormat::kNf4:
    case LowbitFormat::kFp4E2m1: return p.K / 2;
    case LowbitFormat::kIntx: return (p.K * p.bits + 7) / 8;
    default: return p.K;
  }
}

// Scale and offset of group gi of the row whose scale row starts at base = (n / bn) * G (E8M0 exponents and
// double-quantized NF4 absmax decoded here, per group: no per-call scale tensor). The loops compute base
// once per row: no division per group.
inline int64_t scale_base(const LowbitArgs& p, int64_t n) { return (n / p.bn) * p.G; }
inline float scale_at(const LowbitArgs& p, int64_t base, int64_t gi) {
  const int64_t i = base + gi;
  if (p.scale) return p.scale[i] * p.scale_mul;
  if (p.scale_e8m0) {  // 2^(e - 127): float bits e << 23; e = 0 is the subnormal 2^-127 (bits 0x00400000)
    const uint32_t e = p.scale_e8m0[i], bits = e ? e << 23 : 0x00400000u;
    float s;
    std::memcpy(&s, &bits, 4);
    return s * p.scale_mul;
  }
  return (float)p.dq_codes[i] * p.dq_scale[i >> 8] + p.dq_offset;
}
inline float offset_at(const LowbitArgs& p, int64_t base, int64_t gi) { return p.offset ? p.offset[base + gi] : 0.f; }
inline float row_scale(const LowbitArgs& p, int64_t n, int64_t gi) { return scale_at(p, scale_base(p, n), gi); }
inline float row_offset(const LowbitArgs& p, int64_t n, int64_t gi) { return offset_at(p, scale_base(p, n), gi); }

// Chunks may share one scale when groups are whole chunks (or one group spans the row); otherwise each
// lane gets its group's scale (slow, for unusual group sizes only).
inline bool chunk_aligned(const LowbitArgs& p) { return p.G == 1 || p.g % 16 == 0; }

// Row bytes of a decoded fp32 block (prefill): whole chunks of 16 floats, never a tail copy.
inline int64_t nch64(const LowbitArgs& p) { return (p.K + 15) / 16 * 64; }

// out[m, n] = v (+ out[m, n] when accumulating k blocks) (+ bias[n]).
inline void store(const LowbitArgs& p, int64_t m, int64_t n, float v) {
  float* o = p.out + m * p.ldo + n;
  *o = (p.accumulate ? *o : 0.f) + v + (p.bias ? p.bias[n] : 0.f);
}

// Chunk c of a row: a pointer into the row, or (last partial chunk) to a zero-padded copy in tmp.
inline const uint8_t* chunk_ptr(const uint8_t* row, int64_t c, int64_t cb, int64_t rb, uint8_t* tmp) {
  const int64_t b0 = c * cb;
  if (b0 + cb <= rb) return row + b0;
  std::memset(tmp, 0, 32);
  std::memcpy(tmp, row + b0, rb - b0);
  return tmp;
}

constexpr int64_t kPrefillRows = 32;   // 32 rows x 1024 k of fp32 = 128 KiB: the decoded block stays in L2
constexpr int64_t kPrefillK = 1024;

// The dot kernels' view of a decoded fp32 block: rows b0..b0+nb of the output, columns k0..k0+kc of x,
// scale 1, no offset; accumulates after the first k block, adds the bias on the last.
LowbitArgs block_args(const LowbitArgs& p, const float* buf, const float* one, int64_t b0, int64_t nb, int64_t k0,
                      int64_t kc) {
  LowbitArgs q = p;
  q.x = p.x + k0;
  q.K = kc;
  q.w = reinterpret_cast<const uint8_t*>(buf);
  q.ldw = kPrefillK * sizeof(float);
  q.N = nb;
  q.scale = one;
  q.scale_mul = 1.f;
  q.offset = nullptr;
  q.G = 1;
  q.g = kc;
  q.bn = nb;
  q.out = p.out + b0;
  q.bias = k0 + kc == p.K && p.bias ? p.bias + b0 : nullptr;
  q.accumulate = k0 > 0;
  return q;
}

// ================================================================================================
// Scalar
// ================================================================================================
namespace scalar {

float fp8_e4m3(uint8_t b) {  // value / 256 (the glue folds 256 into the scale; see kernels.h)
  const int e = (b >> 3) & 0xF, m = b & 7;
  float v;
  if ((b & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0) v = std::ldexp((float)m, -9);
  else v = std::ldexp(1.f + m / 8.f, e - 7);
  v *= 1.f / 256.f;
  return (b & 0x80) ? -v : v;
}

float fp8_e5m2(uint8_t b) {
  const int e = (b >> 2) & 0x1F, m = b & 3;
  float v;
  if (e == 31) v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else if (e == 0) v = std::ldexp((float)m, -16);
  else v = std::ldexp(1.f + m / 4.f, e - 15);
  return (b & 0x80) ? -v : v;
}

float level(const LowbitArgs& p, const uint8_t* row, int64_t k) {
  switch (p.fmt) {
    case LowbitFormat::kNf4: return kNf4[(k & 1) ? row[k >> 1] & 0xF : row[k >> 1] >> 4];
    case LowbitFormat::kFp4E2m1: return kFp4[(k & 1) ? row[k >> 1] >> 4 : row[k >> 1] & 0xF];
    case LowbitFormat::kFloat8E4m3: return fp8_e4m3(row[k]);
    case LowbitFormat::kFloat8E5m2: return fp8_e5m2(row[k]);
    default: {
      const int64_t bit = k * p.bits, byte = bit >> 3;
      uint32_t v = row[byte];
      if (((bit & 7) + p.bits) > 8) v |= (uint32_t)row[byte + 1] << 8;
      return (float)((v >> (bit & 7)) & ((1u << p.bits) - 1));
    }
  }
}

float weight(const LowbitArgs& p, const uint8_t* row, int64_t n, int64_t k) {
  const int64_t gi = k / p.g;
  return level(p, row, k) * row_scale(p, n, gi) + row_offset(p, n, gi);
}

void dot(const LowbitArgs& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.ldw;
    for (int64_t m = 0; m < p.M; ++m) {
      const float* xr = p.x + m * p.ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc += xr[k] * weight(p, row, n, k);
      p.out[m * p.ldo + n] = acc + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

void decode(const LowbitArgs& p, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
  const int64_t k16 = (p.K + 15) / 16 * 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.ldw;
    float* d = dst + (n - n0) * ldd;
    for (int64_t k = 0; k < p.K; ++k) d[k] = weight(p, row, n, k);
    for (int64_t k = p.K; k < k16; ++k) d[k] = 0.f;
  }
}

}  // namespace scalar

// Fn<decoder>::run(p, a...) for the format of p, the decoder types taken from an ISA level's Decoders.
template <class Dec, template <class> class Fn, class... A>
void by_format(const LowbitArgs& p, A... a) {
  switch (p.fmt) {
    case LowbitFormat::kNf4: return Fn<typename Dec::nf4>::run(p, a...);
    case LowbitFormat::kFp4E2m1: return Fn<typename Dec::fp4>::run(p, a...);
    case LowbitFormat::kFloat8E4m3: return Fn<typename Dec::e4m3>::run(p, a...);
    case LowbitFormat::kFloat8E5m2: return Fn<typename Dec::e5m2>::run(p, a...);
    default: break;
  }
  switch (p.bits) {
    case 1: return Fn<typename Dec::template intx<1>>::run(p, a...);
    case 2: return Fn<typename Dec::template intx<2>>::run(p, a...);
    case 3: return Fn<typename Dec::template intx<3>>::run(p, a...);
    case 4: return Fn<typename Dec::template intx<4>>::run(p, a...);
    case 5: return Fn<typename Dec::template intx<5>>::run(p, a...);
    case 6: return Fn<typename Dec::template intx<6>>::run(p, a...);
    default: return Fn<typename Dec::template intx<7>>::run(p, a...);
  }
}

// ================================================================================================
// AVX-512 F/BW/VL/DQ: 16 lanes = one chunk
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {

// ---------------------------------------------------------------- decoders: chunk bytes -> 16 levels
// 4-bit codes through a 16-entry table: nf4 (element 2j = byte j's high nibble) and fp4 e2m1 (low nibble).
template <const float* kTable, bool kHighFirst>
struct Lut4 {
  static constexpr int kBytes = 8;
  __m512 lut;
  __m512i shifts;  // per element: 4 for the high nibble
  Lut4()
      : lut(_mm512_load_ps(kTable)),
        shifts(kHighFirst ? _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)
                          : _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0)) {}
  __m512 operator()(const uint8_t* b) const {
    __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
    v = _mm_unpacklo_epi8(v, v);  // b0 b0 b1 b1 ...
    const __m512i i = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(v), shifts);
    return _mm512_permutexvar_ps(i, lut);  // uses the index's low 4 bits only
  }
};
using Nf4 = Lut4<kNf4, true>;
using Fp4 = Lut4<kFp4, false>;

// e4m3fn byte -> the fp16 with the same sign, exponent field (4 of fp16's 5 bits) and mantissa: its value
// is the e4m3 value / 256, subnormals included, converted exactly by vcvtph2ps. 0x7F / 0xFF are NaN.
struct F8E4m3 {
  static constexpr int kBytes = 16;
  __m512 operator()(const uint8_t* b) const {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256i em = _mm256_and_si256(v, _mm256_set1_epi16(0x7F));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(em, 7),
                                      _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(em, _mm256_set1_epi16(0x7F));
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
};

// e5m2 is the high byte of an fp16.
struct F8E5m2 {
  static constexpr int kBytes = 16;
  __m512 operator()(const uint8_t* b) const {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(v, 8));
  }
};

// 16 fields of B bits = 2B bytes. Lane j reads the 4 bytes from byte (j B) / 8 (pshufb on the chunk
// broadcast to every 128-bit lane; indices past the chunk read 0) and shifts right by (j B) % 8.
template <int B>
struct Intx {
  static constexpr int kBytes = 2 * B;
  __m512i ctrl, shifts;
  Intx() {
    alignas(64) int8_t c[64];
    alignas(64) int32_t s[16];
    for (int j = 0; j < 16; ++j) {
      const int bit = j * B;
      for (int t = 0; t < 4; ++t) {
        const int byte = bit / 8 + t;
        c[4 * j + t] = byte < 2 * B ? (int8_t)byte : (int8_t)0x80;
      }
      s[j] = bit % 8;
    }
    ctrl = _mm512_load_si512(c);
    shifts = _mm512_load_si512(s);
  }
  __m512 operator()(const uint8_t* b) const {
    const __m128i v = _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * B)) - 1), b);
    const __m512i d = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(v), ctrl);
    const __m512i f = _mm512_and_si512(_mm512_srlv_epi32(d, shifts), _mm512_set1_epi32((1 << B) - 1));
    return _mm512_cvtepi32_ps(f);
  }
};

// Per-lane scales (and offsets) of chunk c of row n when groups are not whole chunks.
inline void lane_scales(const LowbitArgs& p, int64_t n, int64_t c, __m512* s, __m512* o) {
  alignas(64) float sv[16], ov[16];
  for (int j = 0; j < 16; ++j) {
    const int64_t gi = std::min((16 * c + j) / p.g, p.G - 1);
    sv[j] = row_scale(p, n, gi);
    ov[j] = row_offset(p, n, gi);
  }
  *s = _mm512_load_ps(sv);
  *o = _mm512_load_ps(ov);
}

// ---------------------------------------------------------------- dot kernel
constexpr int NB = 4;
constexpr int64_t kPfBytes = 4096;  // Note [decode prefetch] in linear_int4.cpp

// Chunk c (16 k) of NB rows (decoded from src[i]) x MB tokens. A function, not a lambda: Note [accumulators
// in registers] in kernels.h.
template <class D, int MB, bool OFF>
__attribute__((always_inline)) inline void dot_step(__m512 (&acc)[MB][NB], const D& dec, const uint8_t* const (&src)[NB],
                                                    const float* const (&xr)[MB], const __m512 (&sv)[NB],
                                                    const __m512 (&ov)[NB], int64_t c) {
  __m512 wv[NB];
  for (int i = 0; i < NB; ++i) {
    const __m512 lv = dec(src[i]);
    wv[i] = OFF ? _mm512_fmadd_ps(lv, sv[i], ov[i]) : _mm512_mul_ps(lv, sv[i]);
  }
  for (int m = 0; m < MB; ++m) {
    const __m512 xv = _mm512_loadu_ps(xr[m] + 16 * c);
    for (int i = 0; i < NB; ++i) acc[m][i] = _mm512_fmadd_ps(xv, wv[i], acc[m][i]);
  }
}

template <class D, int MB, bool OFF = false>
void dot_tile(const LowbitArgs& p, const D& dec, int64_t m0, int64_t n0, int nr) {
  const int64_t cb = D::kBytes, rb = D::kBytes == 64 ? nch64(p) : row_bytes(p), nch = (p.K + 15) / 16;
  const uint8_t* wr[NB];
  int64_t rn[NB], base[NB];
  for (int i = 0; i < NB; ++i) {
    rn[i] = n0 + std::min(i, nr - 1);
    wr[i] = p.w + rn[i] * p.ldw;
    base[i] = scale_base(p, rn[i]);
  }
  const float* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = p.x + (m0 + m) * p.ldx;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NB; ++i) acc[m][i] = _mm512_setzero_ps();
  alignas(64) uint8_t tmp[NB][32];
  const bool aligned = chunk_aligned(p);
  const int64_t per_group = aligned ? (p.G == 1 ? nch : p.g / 16) : 1, nfull = rb / cb;
  __m512 sv[NB], ov[NB];
  for (int64_t c0 = 0, gi = 0; c0 < nch; c0 += per_group, ++gi) {
    for (int i = 0; i < NB; ++i) {
      if (aligned) {
        sv[i] = _mm512_set1_ps(scale_at(p, base[i], gi));
        ov[i] = _mm512_set1_ps(offset_at(p, base[i], gi));
      } else {
        lane_scales(p, rn[i], c0, &sv[i], &ov[i]);
      }
    }
    const int64_t c1 = std::min(nch, c0 + per_group);
    int64_t c = c0;
    for (const int64_t cf = std::min(c1, nfull); c < cf; ++c) {
      if (((c * cb) & 63) < cb)  // a new cache line: Note [decode prefetch] in linear_int4.cpp
        for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + c * cb + kPfBytes), _MM_HINT_T1);
      const uint8_t* src[NB];
      for (int i = 0; i < NB; ++i) src[i] = wr[i] + c * cb;
      dot_step<D, MB, OFF>(acc, dec, src, xr, sv, ov, c);
    }
    for (; c < c1; ++c) {
      const uint8_t* src[NB];
      for (int i = 0; i < NB; ++i) src[i] = chunk_ptr(wr[i], c, cb, rb, tmp[i]);
      dot_step<D, MB, OFF>(acc, dec, src, xr, sv, ov, c);
    }
  }
  float red[MB][NB];  // every acc index a compile-time constant: Note [accumulators in registers]
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) red[m][i] = _mm512_reduce_add_ps(acc[m][i]);
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < nr; ++i) store(p, m0 + m, n0 + i, red[m][i]);
}

template <class D>
void dot(const LowbitArgs& p, int64_t n0, int64_t n1) {
  const D dec;
  for (int64_t n = n0; n < n1; n += NB) {
    const int nr = (int)std::min<int64_t>(NB, n1 - n);
    for (int64_t m = 0; m < p.M; m += 4) {
      const bool off = p.offset != nullptr;
      switch (std::min<int64_t>(4, p.M - m) + (off ? 4 : 0)) {
        case 4: dot_tile<D, 4>(p, dec, m, n, nr); break;
        case 3: dot_tile<D, 3>(p, dec, m, n, nr); break;
        case 2: dot_tile<D, 2>(p, dec, m, n, nr); break;
        case 1: dot_tile<D, 1>(p, dec, m, n, nr); break;
        case 8: dot_tile<D, 4, true>(p, dec, m, n, nr); break;
        case 7: dot_tile<D, 3, true>(p, dec, m, n, nr); break;
        case 6: dot_tile<D, 2, true>(p, dec, m, n, nr); break;
        default: dot_tile<D, 1, true>(p, dec, m, n, nr); break;
      }
    }
  }
}

template <class D>
void decode_rows(const LowbitArgs& p, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* dst, int64_t ldd) {
  const D dec;
  const int64_t cb = D::kBytes, rb = row_bytes(p), c0 = k0 / 16, c1 = (k1 + 15) / 16;
  const bool aligned = chunk_aligned(p), has_off = p.offset != nullptr;
  const int64_t per_group = p.G == 1 ? INT64_MAX : std::max<int64_t>(1, p.g / 16);
  alignas(64) uint8_t tmp[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.ldw;
    float* d = dst + (n - n0) * ldd - k0;
    __m512 sv, ov;
    const int64_t base = scale_base(p, n);
    int64_t gi = c0 / per_group, left = 0;  // chunks left in group gi
    for (int64_t c = c0; c < c1; ++c) {
      if (!aligned) {
        lane_scales(p, n, c, &sv, &ov);
      } else if (left-- == 0) {
        left = (c == c0 ? per_group - c0 % per_group : per_group) - 1;
        gi += c == c0 ? 0 : 1;
        sv = _mm512_set1_ps(scale_at(p, base, gi));
        ov = _mm512_set1_ps(offset_at(p, base, gi));
      }
      const __m512 lv = dec((c + 1) * cb > rb ? chunk_ptr(row, c, cb, rb, tmp) : row + c * cb);
      _mm512_storeu_ps(d + 16 * c, has_off ? _mm512_fmadd_ps(lv, sv, ov) : _mm512_mul_ps(lv, sv));
    }
  }
}

// ---------------------------------------------------------------- prefill
// A block of kPrefillRows rows x kPrefillK columns decoded to fp32 (L2), then the dot tiles run over it with
// 4 tokens x 4 rows per tile (the x tile stays in L1), accumulating k blocks into the output.
struct F32 {  // 16 decoded fp32 weights
  static constexpr int kBytes = 64;
  __m512 operator()(const uint8_t* b) const { return _mm512_loadu_ps(reinterpret_cast<const float*>(b)); }
};

template <class D>
void prefill(const LowbitArgs& p, int64_t n0, int64_t n1) {
  std::vector<float> buf(kPrefillRows * kPrefillK);
  const float one = 1.f;
  const F32 f32;
  for (int64_t b0 = n0; b0 < n1; b0 += kPrefillRows) {
    const int64_t nb = std::min<int64_t>(kPrefillRows, n1 - b0);
    for (int64_t k0 = 0; k0 < p.K; k0 += kPrefillK) {
      const int64_t kc = std::min<int64_t>(kPrefillK, p.K - k0);
      decode_rows<D>(p, b0, b0 + nb, k0, k0 + kc, buf.data(), kPrefillK);
      const LowbitArgs q = block_args(p, buf.data(), &one, b0, nb, k0, kc);
      for (int64_t m = 0; m < p.M; m += 4)
        for (int64_t n = 0; n < nb; n += NB) {
          const int nr = (int)std::min<int64_t>(NB, nb - n);
          switch (std::min<int64_t>(4, p.M - m)) {
            case 4: dot_tile<F32, 4>(q, f32, m, n, nr); break;
            case 3: dot_tile<F32, 3>(q, f32, m, n, nr); break;
            case 2: dot_tile<F32, 2>(q, f32, m, n, nr); break;
            default: dot_tile<F32, 1>(q, f32, m, n, nr); break;
          }
        }
    }
  }
}

// M >= kPanelMinM: 32 decoded rows transposed into a k-major panel [kc][32] for the 6x32 FMA micro-kernel
// shared with the int8 / int4 kernels (gemm_f32_6x32, linear_int8.cpp): activations broadcast, weights
// streamed from L1, the register-blocked GEMM shape.
constexpr int64_t kPanelMinM = 64;  // below: the dot-tile prefill (bench_linear.py --formats, M = 32)
constexpr int64_t kPanelK = 256;  // 256 x 32 fp32 = 32 KiB panel

template <class D>
void prefill_panel(const LowbitArgs& p, int64_t n0, int64_t n1) {
  std::vector<float> rows(32 * kPanelK), panel(kPanelK * 32);
  for (int64_t b0 = n0; b0 < n1; b0 += 32) {
    const int nb = (int)std::min<int64_t>(32, n1 - b0);
    for (int64_t k0 = 0; k0 < p.K; k0 += kPanelK) {
      const int64_t kc = std::min<int64_t>(kPanelK, p.K - k0);
      decode_rows<D>(p, b0, b0 + nb, k0, k0 + kc, rows.data(), kPanelK);
      for (int64_t k = 0; k < kc; ++k)
        for (int j = 0; j < 32; ++j) panel[k * 32 + j] = j < nb ? rows[j * kPanelK + k] : 0.f;
      for (int64_t m = 0; m < p.M; m += 6)
        gemm_f32_6x32((int)std::min<int64_t>(6, p.M - m), p.x + m * p.ldx + k0, p.ldx, panel.data(), kc,
                      p.out + m * p.ldo + b0, p.ldo, nb, k0 == 0);
    }
    if (p.bias) {
      const __mmask16 m0 = nb >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nb) - 1);
      const __mmask16 m1 = nb >= 32 ? (__mmask16)0xFFFF : nb <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nb - 16)) - 1);
      const __m512 bv0 = _mm512_maskz_loadu_ps(m0, p.bias + b0), bv1 = _mm512_maskz_loadu_ps(m1, p.bias + b0 + 16);
      for (int64_t m = 0; m < p.M; ++m) {
        float* o = p.out + m * p.ldo + b0;
        _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), bv0));
        _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), bv1));
      }
    }
  }
}

template <class D> struct PrefillFn {
  static void run(const LowbitArgs& p, int64_t n0, int64_t n1) {
    p.M >= kPanelMinM ? prefill_panel<D>(p, n0, n1) : prefill<D>(p, n0, n1);
  }
};

// This level's decoders, for by_format.
struct Decoders {
  using nf4 = Nf4;
  using fp4 = Fp4;
  using e4m3 = F8E4m3;
  using e5m2 = F8E5m2;
  template <int B> using intx = Intx<B>;
};
template <class D> struct DotFn { static void run(const LowbitArgs& p, int64_t n0, int64_t n1) { dot<D>(p, n0, n1); } };

}  // namespace avx512
#pragma GCC pop_options

// ================================================================================================
// AVX2 + FMA + F16C: a chunk is two 8-lane halves
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

struct Half { __m256 v[2]; };

template <const float* kTable, bool kHighFirst>  // see avx512::Lut4
struct Lut4 {
  static constexpr int kBytes = 8;
  __m256 lo, hi;
  __m256i shifts;
  Lut4()
      : lo(_mm256_load_ps(kTable)),
        hi(_mm256_load_ps(kTable + 8)),
        shifts(kHighFirst ? _mm256_set_epi32(0, 4, 0, 4, 0, 4, 0, 4) : _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0)) {}
  __m256 half(const uint8_t* b) const {  // 4 bytes -> 8 levels
    int32_t raw;
    std::memcpy(&raw, b, 4);
    __m128i v = _mm_cvtsi32_si128(raw);
    v = _mm_unpacklo_epi8(v, v);
    const __m256i i = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(v), shifts), _mm256_set1_epi32(0xF));
    const __m256 l = _mm256_permutevar8x32_ps(lo, i), h = _mm256_permutevar8x32_ps(hi, i);
    return _mm256_blendv_ps(l, h, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));  // bit 3 -> sign bit
  }
  Half operator()(const uint8_t* b) const { return {{half(b), half(b + 4)}}; }
};
using Nf4 = Lut4<kNf4, true>;
using Fp4 = Lut4<kFp4, false>;

inline __m128i load8(const uint8_t* b) {
  int64_t raw;
  std::memcpy(&raw, b, 8);
  return _mm_cvtepu8_epi16(_mm_cvtsi64_si128(raw));
}

struct F8E4m3 {  // see avx512::F8E4m3
  static constexpr int kBytes = 16;
  __m256 half(const uint8_t* b) const {
    const __m128i v = load8(b);
    const __m128i em = _mm_and_si128(v, _mm_set1_epi16(0x7F));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(em, 7), _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8));
    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(em, _mm_set1_epi16(0x7F))));
    return _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
  }
  Half operator()(const uint8_t* b) const { return {{half(b), half(b + 8)}}; }
};

struct F8E5m2 {
  static constexpr int kBytes = 16;
  __m256 half(const uint8_t* b) const { return _mm256_cvtph_ps(_mm_slli_epi16(load8(b), 8)); }
  Half operator()(const uint8_t* b) const { return {{half(b), half(b + 8)}}; }
};

template <int B>
struct Intx {  // 8 fields = B bytes per half; see avx512::Intx
  static constexpr int kBytes = 2 * B;
  __m256i ctrl, shifts;
  Intx() {
    alignas(32) int8_t c[32];
    alignas(32) int32_t s[8];
    for (int j = 0; j < 8; ++j) {
      const int bit = j * B;
      for (int t = 0; t < 4; ++t) {
        const int byte = bit / 8 + t;
        c[4 * j + t] = byte < B ? (int8_t)byte : (int8_t)0x80;
      }
      s[j] = bit % 8;
    }
    ctrl = _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
    shifts = _mm256_load_si256(reinterpret_cast<const __m256i*>(s));
  }
  __m256 half(const uint8_t* b) const {
    int64_t raw = 0;
    std::memcpy(&raw, b, B);
    const __m256i d = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_cvtsi64_si128(raw)), ctrl);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(d, shifts), _mm256_set1_epi32((1 << B) - 1)));
  }
  Half operator()(const uint8_t* b) const { return {{half(b), half(b + B)}}; }
};

inline void lane_scales(const LowbitArgs& p, int64_t n, int64_t c, Half* s, Half* o) {
  alignas(32) float sv[16], ov[16];
  for (int j = 0; j < 16; ++j) {
    const int64_t gi = std::min((16 * c + j) / p.g, p.G - 1);
    sv[j] = row_scale(p, n, gi);
    ov[j] = row_offset(p, n, gi);
  }
  *s = {{_mm256_load_ps(sv), _mm256_load_ps(sv + 8)}};
  *o = {{_mm256_load_ps(ov), _mm256_load_ps(ov + 8)}};
}

constexpr int NB = 4;
constexpr int64_t kPfBytes = 4096;  // Note [decode prefetch] in linear_int4.cpp

template <class D, int MB, bool OFF = false>
void dot_tile(const LowbitArgs& p, const D& dec, int64_t m0, int64_t n0, int nr) {
  const int64_t cb = D::kBytes, rb = D::kBytes == 64 ? nch64(p) : row_bytes(p), nch = (p.K + 15) / 16;
  const uint8_t* wr[NB];
  int64_t rn[NB], base[NB];
  for (int i = 0; i < NB; ++i) {
    rn[i] = n0 + std::min(i, nr - 1);
    wr[i] = p.w + rn[i] * p.ldw;
    base[i] = scale_base(p, rn[i]);
  }
  const float* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = p.x + (m0 + m) * p.ldx;
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NB; ++i) acc[m][i] = _mm256_setzero_ps();
  alignas(32) uint8_t tmp[NB][32];
  const bool aligned = chunk_aligned(p);
  const int64_t per_group = aligned ? (p.G == 1 ? nch : p.g / 16) : 1, nfull = rb / cb;
  Half sv[NB], ov[NB];
  for (int64_t c0 = 0, gi = 0; c0 < nch; c0 += per_group, ++gi) {
    for (int i = 0; i < NB; ++i) {
      if (aligned) {
        const __m256 s = _mm256_set1_ps(scale_at(p, base[i], gi)), o = _mm256_set1_ps(offset_at(p, base[i], gi));
        sv[i] = {{s, s}};
        ov[i] = {{o, o}};
      } else {
        lane_scales(p, rn[i], c0, &sv[i], &ov[i]);
      }
    }
    const int64_t c1 = std::min(nch, c0 + per_group);
    for (int64_t c = c0; c < c1; ++c) {
      const bool tail = c >= nfull;
      if (((c * cb) & 63) < cb)  // a new cache line: Note [decode prefetch] in linear_int4.cpp
        for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + c * cb + kPfBytes), _MM_HINT_T1);
      for (int h = 0; h < 2; ++h) {
        __m256 wv[NB];
        for (int i = 0; i < NB; ++i) {
          const uint8_t* src = tail ? chunk_ptr(wr[i], c, cb, rb, tmp[i]) : wr[i] + c * cb;
          const __m256 lv = dec.half(src + h * (cb / 2));
          wv[i] = OFF ? _mm256_fmadd_ps(lv, sv[i].v[h], ov[i].v[h]) : _mm256_mul_ps(lv, sv[i].v[h]);
        }
        for (int m = 0; m < MB; ++m) {
          const __m256 xv = _mm256_loadu_ps(xr[m] + 16 * c + 8 * h);
          for (int i = 0; i < NB; ++i) acc[m][i] = _mm256_fmadd_ps(xv, wv[i], acc[m][i]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < nr; ++i)
      store(p, m0 + m, n0 + i, hsum(acc[m][i]));
}

template <class D>
void dot(const LowbitArgs& p, int64_t n0, int64_t n1) {
  const D dec;
  for (int64_t n = n0; n < n1; n += NB) {
    const int nr = (int)std::min<int64_t>(NB, n1 - n);
    int64_t m = 0;
    if (p.offset) {
      for (; m + 2 <= p.M; m += 2) dot_tile<D, 2, true>(p, dec, m, n, nr);
      if (m < p.M) dot_tile<D, 1, true>(p, dec, m, n, nr);
    } else {
      for (; m + 2 <= p.M; m += 2) dot_tile<D, 2>(p, dec, m, n, nr);
      if (m < p.M) dot_tile<D, 1>(p, dec, m, n, nr);
    }
  }
}

template <class D>
void decode_rows(const LowbitArgs& p, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* dst, int64_t ldd) {
  const D dec;
  const int64_t cb = D::kBytes, rb = row_bytes(p), c0 = k0 / 16, c1 = (k1 + 15) / 16;
  const bool aligned = chunk_aligned(p), has_off = p.offset != nullptr;
  const int64_t per_group = p.G == 1 ? INT64_MAX : std::max<int64_t>(1, p.g / 16);
  alignas(32) uint8_t tmp[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.ldw;
    float* d = dst + (n - n0) * ldd - k0;
    Half sv, ov;
    const int64_t base = scale_base(p, n);
    int64_t gi = c0 / per_group, left = 0;  // chunks left in group gi
    for (int64_t c = c0; c < c1; ++c) {
      if (!aligned) {
        lane_scales(p, n, c, &sv, &ov);
      } else if (left-- == 0) {
        left = (c == c0 ? per_group - c0 % per_group : per_group) - 1;
        gi += c == c0 ? 0 : 1;
        const __m256 s = _mm256_set1_ps(scale_at(p, base, gi)), o = _mm256_set1_ps(offset_at(p, base, gi));
        sv = {{s, s}};
        ov = {{o, o}};
      }
      const Half lv = dec((c + 1) * cb > rb ? chunk_ptr(row, c, cb, rb, tmp) : row + c * cb);
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(d + 16 * c + 8 * h,
                         has_off ? _mm256_fmadd_ps(lv.v[h], sv.v[h], ov.v[h]) : _mm256_mul_ps(lv.v[h], sv.v[h]));
    }
  }
}

struct F32 {  // see avx512::prefill
  static constexpr int kBytes = 64;
  __m256 half(const uint8_t* b) const { return _mm256_loadu_ps(reinterpret_cast<const float*>(b)); }
};

template <class D>
void prefill(const LowbitArgs& p, int64_t n0, int64_t n1) {
  std::vector<float> buf(kPrefillRows * kPrefillK);
  const float one = 1.f;
  const F32 f32;
  for (int64_t b0 = n0; b0 < n1; b0 += kPrefillRows) {
    const int64_t nb = std::min<int64_t>(kPrefillRows, n1 - b0);
    for (int64_t k0 = 0; k0 < p.K; k0 += kPrefillK) {
      const int64_t kc = std::min<int64_t>(kPrefillK, p.K - k0);
      decode_rows<D>(p, b0, b0 + nb, k0, k0 + kc, buf.data(), kPrefillK);
      const LowbitArgs q = block_args(p, buf.data(), &one, b0, nb, k0, kc);
      for (int64_t m = 0; m < p.M; m += 2)
        for (int64_t n = 0; n < nb; n += NB) {
          const int nr = (int)std::min<int64_t>(NB, nb - n);
          if (m + 2 <= p.M) dot_tile<F32, 2>(q, f32, m, n, nr);
          else dot_tile<F32, 1>(q, f32, m, n, nr);
        }
    }
  }
}

template <class D> struct PrefillFn { static void run(const LowbitArgs& p, int64_t n0, int64_t n1) { prefill<D>(p, n0, n1); } };
// Whole rows: chunks of 16 up to K rounded up to 16 (a partial last chunk decodes the zero padding of chunk_ptr).
template <class D> struct DecodeFn {
  static void run(const LowbitArgs& p, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
    decode_rows<D>(p, n0, n1, 0, p.K, dst, ldd);
  }
};

// This level's decoders, for by_format.
struct Decoders {
  using nf4 = Nf4;
  using fp4 = Fp4;
  using e4m3 = F8E4m3;
  using e5m2 = F8E5m2;
  template <int B> using intx = Intx<B>;
};
template <class D> struct DotFn { static void run(const LowbitArgs& p, int64_t n0, int64_t n1) { dot<D>(p, n0, n1); } };

}  // namespace avx2
#pragma GCC pop_options

// Every AVX2 CPU also has F16C (float8 decode); a CPU without it runs the scalar level.
Isa lowbit_isa(Isa isa) {
  __builtin_cpu_init();
  if (isa == Isa::kAvx2 && !__builtin_cpu_supports("f16c")) return Isa::kScalar;
  return isa;
}

}  // namespace

void linear_lowbit_dot(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1) {
  switch (lowbit_isa(isa)) {
    case Isa::kAvx512Vnni: return by_format<avx512::Decoders, avx512::DotFn>(p, n0, n1);
    case Isa::kAvx2: return by_format<avx2::Decoders, avx2::DotFn>(p, n0, n1);
    default: return scalar::dot(p, n0, n1);
  }
}

void linear_lowbit_prefill(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1) {
  switch (lowbit_isa(isa)) {
    case Isa::kAvx512Vnni: return by_format<avx512::Decoders, avx512::PrefillFn>(p, n0, n1);
    case Isa::kAvx2: return by_format<avx2::Decoders, avx2::PrefillFn>(p, n0, n1);
    default: return scalar::dot(p, n0, n1);
  }
}

void linear_lowbit_decode(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
  if (lowbit_isa(isa) == Isa::kScalar) return scalar::decode(p, n0, n1, dst, ldd);
  by_format<avx2::Decoders, avx2::DecodeFn>(p, n0, n1, dst, ldd);  // AVX-512 CPUs run AVX2 too
}

}  // namespace torchqkit_cpu
