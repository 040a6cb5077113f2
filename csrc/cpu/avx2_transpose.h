// An 8 x 8 transpose of 32-bit lanes in AVX2 registers, shared by the 256-bit panel packers (int8 prefill panels,
// fp32 panels of the dequantized prefill).
//
// Declared with its own target attribute, like avx2_reduce.h: include it at the top of a file and call it from that
// file's `#pragma GCC target("avx2,...")` regions.
#pragma once
#include <immintrin.h>

namespace torchqkit_cpu {

// r[i] lane j -> r[j] lane i.
__attribute__((target("avx2"))) inline void transpose8(__m256i (&r)[8]) {
  __m256i t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m256i u[8];
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + h] = _mm256_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);
      u[4 * i + 2 + h] = _mm256_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);
    }
  // u[0..3] hold rows 0-3 (lanes 0,1 | 4,5 ; 2,3 | 6,7 ...), u[4..7] rows 4-7: combine 128-bit halves.
  const int order[4] = {0, 2, 1, 3};
  for (int j = 0; j < 4; ++j) {
    r[order[j]] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[order[j] + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

}  // namespace torchqkit_cpu
