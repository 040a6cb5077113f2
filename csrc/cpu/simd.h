// Vector-width traits for the per-ISA CPU kernels: one struct per x86 level with the same names, so a kernel
// written once over `V` (a template parameter) is instantiated per ISA instead of copied by hand.
//
//   V::L            fp32 lanes (16 AVX-512, 8 AVX2);  V::kRegs  vector registers (32 zmm, 16 ymm)
//   V::F / V::I     fp32 / int32 vector of L lanes;  V::H  L 16-bit lanes (half width)
//   arithmetic      zero, set1, loadu, storeu, fmadd, mul, add, sub, div, min, max, abs, reduce (horizontal
//                   sum), reduce_max / reduce_min, round_even (to an integral float, ties to even),
//                   loadu_n(p, n) (the first n lanes of p, the rest 0; 0 < n < L)
//   integer         zero_i, set1_i, load_i, add_i, and_i, or_i, sub_i, srlv (per-lane right shift), srli_i<n> /
//                   slli_i<n> (every lane >> / << n, logical), narrow16 (int32 lanes 0..65535 -> H), shuffle_bytes
//                   (pshufb within each 128-bit lane), broadcast128 (the same 16 bytes in every 128-bit lane),
//                   cvt (int32 -> fp32), cvt_i (fp32 -> int32, rounding), reduce_i (horizontal int32 sum)
//   bytes           u8_to_i32<T>(c): bytes [T L, T L + L) of c zero-extended to int32 lanes;
//                   hi16<T>(b): bytes b[T L, T L + L) as 16-bit lanes holding byte << 8;
//                   sx16<T>(b): the same bytes sign-extended to 16-bit lanes;
//                   s8_to_f(p) / s8_to_f_n(p, n): L (or the first n) int8 at p as fp32;
//                   store_u8(p, v): the L int32 lanes of v (each 0..255) as L bytes at p
//   u8 x s8 dot     kDotBytes k per step (64: vpdpbusd zmm, AVX-512 VNNI; 16: vpmaddwd on int16, AVX2, exact
//                   for u8 x s8); A / B = one step of activation (u8) / weight (s8) bytes as dot operands:
//                   load_a(p), load_b(p), load_b_n(p, n) (n < kDotBytes bytes, the rest 0);
//                   dot(acc, a, b) adds each lane's products to acc's int32 lanes; sum_b(acc, b) adds b's bytes
//   16-bit          and_h, or_h, srai1_h (arithmetic >> 1), srli1_h (logical >> 1), slli7_h (<< 7), sub_h, max_h
//                   (signed), cmpeq_h, set1_h, half_to_f (fp16 bits -> fp32)
//   halves(a, b)    lanes j < L / 2 = *a, the others *b
//   Lut16           a 16-entry fp32 table in registers; lookup(t, i) = table[i & 15] per lane (reads bits 0..3 only)
//   kPermEntries    entries of the one-instruction table lookup perm(table, i) = table[i % kPermEntries] (a vector
//                   as the table: 16 for vpermps zmm, 8 for vpermps ymm)
//
// Each struct's member functions carry their ISA's target attribute, so this header is included once at the
// top of a file; the code that uses V is compiled inside that file's matching `#pragma GCC target` region
// (GCC inlines a callee whose target is a subset of the caller's). Vec512's dot step also needs AVX-512 VNNI:
// only a region with that target may call it.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "avx2_reduce.h"

namespace torchqkit_cpu {

#define TQK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), always_inline)) static inline
#define TQK_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"), always_inline)) static inline
#define TQK_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

// The members whose AVX-512 and AVX2 forms differ only in the intrinsics' prefix (P: _mm512 / _mm256) and
// integer-vector suffix (SI: si512 / si256); HP / HSI the same for the half-width 16-bit vectors H.
#define TQK_SAME_SHAPED_OPS(ATTR, P, SI, HP, HSI)                                  \
  ATTR F zero() { return P##_setzero_ps(); }                                      \
  ATTR F set1(float v) { return P##_set1_ps(v); }                                 \
  ATTR F loadu(const float* p) { return P##_loadu_ps(p); }                        \
  ATTR void storeu(float* p, F v) { P##_storeu_ps(p, v); }                        \
  ATTR F fmadd(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }                   \
  ATTR F mul(F a, F b) { return P##_mul_ps(a, b); }                               \
  ATTR F add(F a, F b) { return P##_add_ps(a, b); }                               \
  ATTR F sub(F a, F b) { return P##_sub_ps(a, b); }                               \
  ATTR F div(F a, F b) { return P##_div_ps(a, b); }                               \
  ATTR F min(F a, F b) { return P##_min_ps(a, b); }                               \
  ATTR F max(F a, F b) { return P##_max_ps(a, b); }                               \
  ATTR F abs(F a) { return P##_and_ps(a, P##_cast##SI##_ps(P##_set1_epi32(0x7fffffff))); } \
  ATTR I zero_i() { return P##_setzero_##SI(); }                                  \
  ATTR I set1_i(int v) { return P##_set1_epi32(v); }                              \
  ATTR I load_i(const void* p) { return P##_loadu_##SI(static_cast<const I*>(p)); } \
  ATTR I add_i(I a, I b) { return P##_add_epi32(a, b); }                          \
  ATTR I and_i(I a, I b) { return P##_and_##SI(a, b); }                           \
  ATTR I sub_i(I a, I b) { return P##_sub_epi32(a, b); }                          \
  ATTR I srlv(I a, I s) { return P##_srlv_epi32(a, s); }                          \
  template <int n> ATTR I srli_i(I a) { return P##_srli_epi32(a, n); }            \
  template <int n> ATTR I slli_i(I a) { return P##_slli_epi32(a, n); }            \
  ATTR I or_i(I a, I b) { return P##_or_##SI(a, b); }                             \
  ATTR I shuffle_bytes(I a, I ctrl) { return P##_shuffle_epi8(a, ctrl); }         \
  ATTR F cvt(I v) { return P##_cvtepi32_ps(v); }                                  \
  ATTR F scale_pow2(F y, I n) { /* y * 2^n, n a normal exponent */                 \
    return P##_mul_ps(y, P##_cast##SI##_ps(P##_slli_epi32(P##_add_epi32(n, P##_set1_epi32(127)), 23))); } \
  ATTR I cvt_i(F v) { return P##_cvtps_epi32(v); }                                \
  ATTR F s8_to_f(const int8_t* p) { return cvt(P##_cvtepi8_epi32(load_bytes(p))); } \
  ATTR H and_h(H a, H b) { return HP##_and_##HSI(a, b); }                         \
  ATTR H or_h(H a, H b) { return HP##_or_##HSI(a, b); }                           \
  ATTR H srai1_h(H a) { return HP##_srai_epi16(a, 1); }                           \
  ATTR H srli1_h(H a) { return HP##_srli_epi16(a, 1); }                           \
  ATTR H sub_h(H a, H b) { return HP##_sub_epi16(a, b); }                         \
  ATTR H max_h(H a, H b) { return HP##_max_epi16(a, b); }                         \
  ATTR H slli7_h(H a) { return HP##_slli_epi16(a, 7); }                           \
  ATTR H cmpeq_h(H a, H b) { return HP##_cmpeq_epi16(a, b); }                     \
  ATTR H set1_h(int16_t v) { return HP##_set1_epi16(v); }                         \
  ATTR F half_to_f(H h) { return P##_cvtph_ps(h); }

// The types and sizes of one width: kL fp32 lanes, kR vector registers, F / I / H as above.
template <int kL, int kR, class F_, class I_, class H_>
struct VecTypes {
  static constexpr int L = kL, kRegs = kR;
  using F = F_;
  using I = I_;
  using H = H_;
};

struct Vec512 : VecTypes<16, 32, __m512, __m512i, __m256i> {
  TQK_AVX512 __m128i load_bytes(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  TQK_SAME_SHAPED_OPS(TQK_AVX512, _mm512, si512, _mm256, si256)
  TQK_AVX512 float reduce(F v) { return _mm512_reduce_add_ps(v); }
  TQK_AVX512 float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  TQK_AVX512 float reduce_min(F v) { return _mm512_reduce_min_ps(v); }
  TQK_AVX512 int32_t reduce_i(I v) { return _mm512_reduce_add_epi32(v); }
  TQK_AVX512 F round_even(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  TQK_AVX512 F zero_below(F x, float t, F y) {  // x < t (or NaN) ? 0 : y
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GE_OQ), y);
  }
  TQK_AVX512 F loadu_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
  TQK_AVX512 F s8_to_f_n(const int8_t* p, int64_t n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p)));
  }
  TQK_AVX512 void store_u8(uint8_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }
  TQK_AVX512 F halves(const float* a, const float* b) {
    return _mm512_mask_broadcastss_ps(_mm512_set1_ps(*a), 0xFF00, _mm_load_ss(b));
  }

  TQK_AVX512 I broadcast128(__m128i v) { return _mm512_broadcast_i32x4(v); }
  TQK_AVX512 H narrow16(I v) { return _mm512_cvtepi32_epi16(v); }
  template <int T>
  TQK_AVX512 I u8_to_i32(__m128i c) {
    static_assert(T == 0, "16 bytes fill one AVX-512 vector");
    return _mm512_cvtepu8_epi32(c);
  }
  template <int T>
  TQK_AVX512 H sx16(const uint8_t* b) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + T * L)));
  }
  template <int T>
  TQK_AVX512 H hi16(const uint8_t* b) {
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + T * L))), 8);
  }

  struct Lut16 { __m512 t; };
  TQK_AVX512 Lut16 lut16(const float* table) { return {_mm512_loadu_ps(table)}; }
  TQK_AVX512 F lookup(const Lut16& t, I i) { return _mm512_permutexvar_ps(i, t.t); }  // reads i's low 4 bits
  static constexpr int kPermEntries = 16;
  TQK_AVX512 F perm(F table, I i) { return _mm512_permutexvar_ps(i, table); }

  // u8 x s8 dot step: 4 bytes per int32 lane, raw bytes as operands.
  static constexpr int kDotBytes = 64;
  using A = __m512i;
  using B = __m512i;
  TQK_AVX512 A load_a(const uint8_t* p) { return _mm512_loadu_si512(p); }
  TQK_AVX512 B load_b(const int8_t* p) { return _mm512_loadu_si512(p); }
  TQK_AVX512 B load_b_n(const int8_t* p, int64_t n) { return _mm512_maskz_loadu_epi8((1ULL << n) - 1, p); }
  // Inline asm because GCC 12 copies the accumulator to a new register around every _mm512_dpbusd_epi32 in an
  // unrolled tile (twice the instructions, measured).
  TQK_AVX512VNNI I dot(I acc, A a, B b) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
  }
  TQK_AVX512VNNI I sum_b(I acc, B b) { return dot(acc, _mm512_set1_epi8(1), b); }
};

struct Vec256 : VecTypes<8, 16, __m256, __m256i, __m128i> {
  TQK_AVX2 __m128i load_bytes(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
  TQK_SAME_SHAPED_OPS(TQK_AVX2, _mm256, si256, _mm, si128)
  TQK_AVX2 float reduce(F v) { return hsum(v); }
  TQK_AVX2 float reduce_max(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  TQK_AVX2 float reduce_min(F v) {
    __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_min_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)));
  }
  TQK_AVX2 int32_t reduce_i(I v) { return hsum(v); }
  TQK_AVX2 F round_even(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  TQK_AVX2 F zero_below(F x, float t, F y) {  // x < t (or NaN) ? 0 : y
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_GE_OQ), y);
  }
  TQK_AVX2 F loadu_n(const float* p, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
  }
  TQK_AVX2 F s8_to_f_n(const int8_t* p, int64_t n) {
    int64_t b = 0;
    std::memcpy(&b, p, n);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(b)));
  }
  TQK_AVX2 void store_u8(uint8_t* p, I v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }

  TQK_AVX2 F halves(const float* a, const float* b) { return _mm256_setr_m128(_mm_set1_ps(*a), _mm_set1_ps(*b)); }
  TQK_AVX2 I broadcast128(__m128i v) { return _mm256_broadcastsi128_si256(v); }
  TQK_AVX2 H narrow16(I v) { return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)); }
  template <int T>
  TQK_AVX2 I u8_to_i32(__m128i c) {
    static_assert(T == 0 || T == 1, "16 bytes fill two AVX2 vectors");
    return _mm256_cvtepu8_epi32(T == 0 ? c : _mm_unpackhi_epi64(c, c));
  }
  template <int T>
  TQK_AVX2 H sx16(const uint8_t* b) {
    return _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + T * L)));
  }
  template <int T>
  TQK_AVX2 H hi16(const uint8_t* b) {
    return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + T * L)));
  }

  static constexpr int kPermEntries = 8;
  TQK_AVX2 F perm(F table, I i) { return _mm256_permutevar8x32_ps(table, i); }

  // vpermps reads 3 index bits: two 8-entry halves, the code's bit 3 (moved to the sign bit) picks one.
  struct Lut16 { __m256 lo, hi; };
  TQK_AVX2 Lut16 lut16(const float* table) { return {_mm256_loadu_ps(table), _mm256_loadu_ps(table + 8)}; }
  TQK_AVX2 F lookup(const Lut16& t, I i) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, i), _mm256_permutevar8x32_ps(t.hi, i),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
  }

  // u8 x s8 dot step: 16 bytes widened to int16, two per int32 lane. vpmaddwd is exact here (|u8 * s8| <=
  // 255 * 128 fits int16 products summed into int32), where vpmaddubsw's saturating int16 pairs are not.
  static constexpr int kDotBytes = 16;
  using A = __m256i;
  using B = __m256i;
  TQK_AVX2 A load_a(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  TQK_AVX2 B load_b(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  TQK_AVX2 B load_b_n(const int8_t* p, int64_t n) {
    alignas(16) int8_t b[16] = {};
    std::memcpy(b, p, n);
    return load_b(b);
  }
  TQK_AVX2 I dot(I acc, A a, B b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  TQK_AVX2 I sum_b(I acc, B b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(b, _mm256_set1_epi16(1))); }
};

#undef TQK_SAME_SHAPED_OPS
#undef TQK_AVX512
#undef TQK_AVX512VNNI
#undef TQK_AVX2

}  // namespace torchqkit_cpu
