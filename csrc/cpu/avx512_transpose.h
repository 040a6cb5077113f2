// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers (the 512-bit twin of avx2_transpose.h).
//
// Declared with its own target attribute: include it at the top of a file and call it from that file's
// `#pragma GCC target("avx512f,...")` regions.
#pragma once
#include <immintrin.h>

namespace torchqkit_cpu {

// r[i] lane j -> r[j] lane i. Three stages: 32-bit and 64-bit interleaves within 128-bit lanes, then a 4 x 4
// transpose of the 128-bit lanes (two shuffle_i32x4 rounds).
__attribute__((target("avx512f"))) inline void transpose16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  // b[4k + c], 128-bit lane L: word 4L + c of rows 4k .. 4k + 3.
  for (int k = 0; k < 4; ++k) {
    b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  // Word 4L + c of every row: lane k of it is lane L of b[4k + c].
  for (int c = 0; c < 4; ++c) {
    const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

}  // namespace torchqkit_cpu
