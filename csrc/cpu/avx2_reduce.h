// Horizontal sums of AVX2 registers, shared by the AVX2 levels of every CPU kernel file.
//
// Declared with their own target attribute, so a file includes this header once, at the top, and
// calls hsum from inside its `#pragma GCC target("avx2,...")` region (GCC inlines a subset target).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace torchqkit_cpu {

__attribute__((target("avx2"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2"))) inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

}  // namespace torchqkit_cpu
