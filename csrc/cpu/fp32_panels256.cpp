// The fp32 GEMM of the dequantized weight-only prefill at the 256-bit levels (AVX2 + FMA): 16 decoded weight rows
// packed k-major into a panel, a 6-token x 16-row register tile of FMAs over it. The driver that decodes the rows
// and hands out the tiles is prefill_by_panels256 (sgemm_prefill.h); Note [fp32 panels at 256 bits] there says why
// this is not ATen's sgemm.
//
// No torch header, like linear_int8.cpp: plain pointers and strides, one `#pragma GCC target` region.
#include "avx2_transpose.h"
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace torchqkit_cpu {
namespace {

// c[R][16] += a[R tokens][k] * panel[k][16] for one k. An always-inline function taking the accumulators by
// reference keeps them in registers (Note [accumulators in registers], kernels.h): written as a loop in the tile
// body, GCC 12 stored all 12 to the stack on every k (60 GFLOP/s on one Zen 5 core instead of 117-122).
template <int R>
__attribute__((always_inline)) inline void fma_step(__m256 (&acc)[R][2], const float* a, int64_t lda,
                                                    const float* panel) {
  const __m256 b0 = _mm256_loadu_ps(panel), b1 = _mm256_loadu_ps(panel + 8);
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) {
    const __m256 av = _mm256_broadcast_ss(a + m * lda);
    acc[m][0] = _mm256_fmadd_ps(av, b0, acc[m][0]);
    acc[m][1] = _mm256_fmadd_ps(av, b1, acc[m][1]);
  }
}

template <int R>
void tile(const float* a, int64_t lda, const float* panel, int64_t kc, float* c, bool first) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) fma_step<R>(acc, a + k, lda, panel + k * kFp32PanelCols);
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      float* cm = c + m * kFp32PanelCols + 8 * h;
      _mm256_storeu_ps(cm, first ? acc[m][h] : _mm256_add_ps(acc[m][h], _mm256_loadu_ps(cm)));
    }
}

}  // namespace

void pack_f32_panel16(const float* rows, int64_t ldr, int nrows, int64_t ncols, const int32_t* to, float* panel) {
  // Column c of the rows goes to panel row to[c] (c itself without a map; nowhere when to[c] < 0).
  auto dest = [&](int64_t c) -> float* {
    const int64_t k = to == nullptr ? c : to[c];
    return k < 0 ? nullptr : panel + k * kFp32PanelCols;
  };
  for (int h = 0; h < 2; ++h) {
    int64_t k = 0;
    for (; k + 8 <= ncols; k += 8) {
      __m256i v[8];
      for (int r = 0; r < 8; ++r)
        v[r] = 8 * h + r < nrows ? _mm256_castps_si256(_mm256_loadu_ps(rows + (8 * h + r) * ldr + k))
                                 : _mm256_setzero_si256();
      transpose8(v);  // v[c]: column k + c of rows 8h .. 8h + 7
      for (int c = 0; c < 8; ++c)
        if (float* d = dest(k + c)) _mm256_storeu_ps(d + 8 * h, _mm256_castsi256_ps(v[c]));
    }
    for (; k < ncols; ++k)
      if (float* d = dest(k))
        for (int r = 0; r < 8; ++r) d[8 * h + r] = 8 * h + r < nrows ? rows[(8 * h + r) * ldr + k] : 0.f;
  }
}

void gemm_f32_6x16(int R, const float* a, int64_t lda, const float* panel, int64_t kc, float* c, bool first) {
  switch (R) {
    case 6: return tile<6>(a, lda, panel, kc, c, first);
    case 5: return tile<5>(a, lda, panel, kc, c, first);
    case 4: return tile<4>(a, lda, panel, kc, c, first);
    case 3: return tile<3>(a, lda, panel, kc, c, first);
    case 2: return tile<2>(a, lda, panel, kc, c, first);
    default: return tile<1>(a, lda, panel, kc, c, first);
  }
}

}  // namespace torchqkit_cpu

#pragma GCC pop_options
