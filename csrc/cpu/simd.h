// Vector-width traits for the per-ISA CPU kernels: one struct per x86 level with the same names, so a kernel
// written once over `V` (a template parameter) is instantiated per ISA instead of copied by hand.
//
//   V::L            fp32 lanes (16 AVX-512, 8 AVX2)
//   V::F / V::I     fp32 / int32 vector of L lanes;  V::H  L 16-bit lanes (half width)
//   arithmetic      zero, set1, loadu, storeu, fmadd, mul, add, reduce (horizontal sum)
//   integer         set1_i, load_i, and_i, sub_i, srlv (per-lane right shift), shuffle_bytes (pshufb within each
//                   128-bit lane), broadcast128 (the same 16 bytes in every 128-bit lane), cvt (int32 -> fp32)
//   bytes           u8_to_i32<T>(c): bytes [T L, T L + L) of c zero-extended to int32 lanes;
//                   hi16<T>(b): bytes b[T L, T L + L) as 16-bit lanes holding byte << 8
//   16-bit          and_h, or_h, srai1_h (arithmetic >> 1), cmpeq_h, set1_h, half_to_f (fp16 bits -> fp32)
//   Lut16           a 16-entry fp32 table in registers; lookup(t, i) = table[i & 15] per lane (reads bits 0..3 only)
//   kPermEntries    entries of the one-instruction table lookup perm(table, i) = table[i % kPermEntries] (a vector
//                   as the table: 16 for vpermps zmm, 8 for vpermps ymm)
//
// Each struct's member functions carry their ISA's target attribute, so this header is included once at the
// top of a file; the code that uses V is compiled inside that file's matching `#pragma GCC target` region
// (GCC inlines a callee whose target is a subset of the caller's).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace torchqkit_cpu {

#define TQK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), always_inline)) static inline
#define TQK_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

struct Vec512 {
  static constexpr int L = 16;
  using F = __m512;
  using I = __m512i;
  using H = __m256i;
  TQK_AVX512 F zero() { return _mm512_setzero_ps(); }
  TQK_AVX512 F set1(float v) { return _mm512_set1_ps(v); }
  TQK_AVX512 F loadu(const float* p) { return _mm512_loadu_ps(p); }
  TQK_AVX512 void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  TQK_AVX512 F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  TQK_AVX512 F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  TQK_AVX512 F add(F a, F b) { return _mm512_add_ps(a, b); }
  TQK_AVX512 float reduce(F v) { return _mm512_reduce_add_ps(v); }

  TQK_AVX512 I set1_i(int v) { return _mm512_set1_epi32(v); }
  TQK_AVX512 I load_i(const void* p) { return _mm512_loadu_si512(p); }
  TQK_AVX512 I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  TQK_AVX512 I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  TQK_AVX512 I srlv(I a, I s) { return _mm512_srlv_epi32(a, s); }
  TQK_AVX512 I shuffle_bytes(I a, I ctrl) { return _mm512_shuffle_epi8(a, ctrl); }
  TQK_AVX512 I broadcast128(__m128i v) { return _mm512_broadcast_i32x4(v); }
  TQK_AVX512 F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  template <int T>
  TQK_AVX512 I u8_to_i32(__m128i c) {
    static_assert(T == 0, "16 bytes fill one AVX-512 vector");
    return _mm512_cvtepu8_epi32(c);
  }
  template <int T>
  TQK_AVX512 H hi16(const uint8_t* b) {
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + T * L))), 8);
  }

  TQK_AVX512 H and_h(H a, H b) { return _mm256_and_si256(a, b); }
  TQK_AVX512 H or_h(H a, H b) { return _mm256_or_si256(a, b); }
  TQK_AVX512 H srai1_h(H a) { return _mm256_srai_epi16(a, 1); }
  TQK_AVX512 H cmpeq_h(H a, H b) { return _mm256_cmpeq_epi16(a, b); }
  TQK_AVX512 H set1_h(int16_t v) { return _mm256_set1_epi16(v); }
  TQK_AVX512 F half_to_f(H h) { return _mm512_cvtph_ps(h); }

  struct Lut16 { __m512 t; };
  TQK_AVX512 Lut16 lut16(const float* table) { return {_mm512_loadu_ps(table)}; }
  TQK_AVX512 F lookup(const Lut16& t, I i) { return _mm512_permutexvar_ps(i, t.t); }  // reads i's low 4 bits
  static constexpr int kPermEntries = 16;
  TQK_AVX512 F perm(F table, I i) { return _mm512_permutexvar_ps(i, table); }
};

struct Vec256 {
  static constexpr int L = 8;
  using F = __m256;
  using I = __m256i;
  using H = __m128i;
  TQK_AVX2 F zero() { return _mm256_setzero_ps(); }
  TQK_AVX2 F set1(float v) { return _mm256_set1_ps(v); }
  TQK_AVX2 F loadu(const float* p) { return _mm256_loadu_ps(p); }
  TQK_AVX2 void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  TQK_AVX2 F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  TQK_AVX2 F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  TQK_AVX2 F add(F a, F b) { return _mm256_add_ps(a, b); }
  TQK_AVX2 float reduce(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  TQK_AVX2 I set1_i(int v) { return _mm256_set1_epi32(v); }
  TQK_AVX2 I load_i(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  TQK_AVX2 I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  TQK_AVX2 I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  TQK_AVX2 I srlv(I a, I s) { return _mm256_srlv_epi32(a, s); }
  TQK_AVX2 I shuffle_bytes(I a, I ctrl) { return _mm256_shuffle_epi8(a, ctrl); }
  TQK_AVX2 I broadcast128(__m128i v) { return _mm256_broadcastsi128_si256(v); }
  TQK_AVX2 F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  template <int T>
  TQK_AVX2 I u8_to_i32(__m128i c) {
    static_assert(T == 0 || T == 1, "16 bytes fill two AVX2 vectors");
    return _mm256_cvtepu8_epi32(T == 0 ? c : _mm_unpackhi_epi64(c, c));
  }
  template <int T>
  TQK_AVX2 H hi16(const uint8_t* b) {
    return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + T * L)));
  }

  TQK_AVX2 H and_h(H a, H b) { return _mm_and_si128(a, b); }
  TQK_AVX2 H or_h(H a, H b) { return _mm_or_si128(a, b); }
  TQK_AVX2 H srai1_h(H a) { return _mm_srai_epi16(a, 1); }
  TQK_AVX2 H cmpeq_h(H a, H b) { return _mm_cmpeq_epi16(a, b); }
  TQK_AVX2 H set1_h(int16_t v) { return _mm_set1_epi16(v); }
  TQK_AVX2 F half_to_f(H h) { return _mm256_cvtph_ps(h); }

  static constexpr int kPermEntries = 8;
  TQK_AVX2 F perm(F table, I i) { return _mm256_permutevar8x32_ps(table, i); }

  // vpermps reads 3 index bits: two 8-entry halves, the code's bit 3 (moved to the sign bit) picks one.
  struct Lut16 { __m256 lo, hi; };
  TQK_AVX2 Lut16 lut16(const float* table) { return {_mm256_loadu_ps(table), _mm256_loadu_ps(table + 8)}; }
  TQK_AVX2 F lookup(const Lut16& t, I i) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, i), _mm256_permutevar8x32_ps(t.hi, i),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
  }
};

#undef TQK_AVX512
#undef TQK_AVX2

}  // namespace torchqkit_cpu
