// int8 linear kernels for x86: scalar, AVX2 + FMA, AVX-512 (F/BW/VL/DQ) + VNNI.
//
// What is the same at every vector width (activation quantization, the dot kernels) is written once in
// linear_int8_isa.h over simd.h's traits and included in each ISA's region below; the panel kernels differ
// in their arithmetic (AVX2: exact int16 vpmaddwd; AVX-512: fp32 FMA and VNNI vpdpbusd) and stay per ISA.
//
// No torch header here: this file only sees the plain structs of kernels.h. Each ISA level is a
// `#pragma GCC target` region, so the file is built without -mavx* flags and the scalar code runs on
// any x86-64 CPU; the glue picks a level at run time (see registration.cpp).
//
// Note [Two loop shapes]:
//   * "dot" kernels (decode, small M): a tile of 4 weight rows x MB activation rows keeps one SIMD
//     accumulator per (row, token) pair, reads the weight rows straight from memory once and reduces the
//     accumulators horizontally at the end. Bandwidth-bound: the weight is read exactly once.
//   * "panel" kernels (prefill: AVX-512 both ops, AVX2 int8 x int8): weight rows are repacked per call, 32 (AVX2: 16) output columns at a
//     time, into a k-major panel (fp32 for weight-only, 4 k-bytes per int32 lane for VNNI) that stays in
//     L2 while every activation row tile (6 rows) streams over it; accumulators are 6 x 2 zmm, each
//     activation value is broadcast. This is the classic register-blocked GEMM shape.
#include "amx_int8_gemm.h"
#include "avx2_transpose.h"
#include "bf16_gemm.h"
#include "kernels.h"
#include "scalar_linear.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

namespace torchqkit_cpu {
namespace {

constexpr float kScaleEps = FLT_MIN;  // the oracle's floor: finfo(float32).tiny, the smallest normal

// Note [Finite range] (core/primitives.py), for activations: a row reaching float32's edge must not give an inf
// scale. The oracle takes hi - lo without overflow and caps a scale so that every code offset times it stays
// within float32's max (less one ulp, for rounding); these two helpers are that arithmetic, bit for bit, and every
// ISA's quantize_rows calls them once per row.
constexpr float kFiniteLimit = FLT_MAX * (1.f - FLT_EPSILON);

// The code range of `bits`-bit activation codes: qmin = -2^(bits - 1), qmax = 2^(bits - 1) - 1 (int8 and int4).
inline float act_qmin(int bits) { return -(float)(1 << (bits - 1)); }
inline float act_qmax(int bits) { return (float)((1 << (bits - 1)) - 1); }

inline float symmetric_act_scale(float amax, int bits) {  // codes qmin..qmax around 0: the largest offset is -qmin
  const float half_range = (act_qmax(bits) - act_qmin(bits)) / 2.f;  // 127.5, 7.5: exact
  const float s = amax > 0.f ? std::max(amax / half_range, kScaleEps) : 1.f;
  return std::min(s, kFiniteLimit / -act_qmin(bits));
}

inline float asymmetric_act_scale(float lo, float hi, int* zp, int bits) {  // lo <= 0 <= hi
  const float qmin = act_qmin(bits), qmax = act_qmax(bits), range = qmax - qmin, span = hi - lo;
  const float s = span > 0.f ? std::max(std::isfinite(span) ? span / range : hi / range - lo / range, kScaleEps) : 1.f;
  *zp = (int)std::fmin(std::fmax(qmin - std::nearbyint(lo / s), qmin), qmax);
  // the zero point stays, as the oracle's
  return std::min(s, kFiniteLimit / std::max((float)*zp - qmin, qmax - (float)*zp));
}
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ================================================================================================
// Scalar: any x86-64 CPU. Also the definition the SIMD versions are tested against (via the oracle).
// ================================================================================================
namespace scalar {

void quantize_rows(const float* x, int64_t ldx, int64_t K, bool symmetric, uint8_t* a, int64_t lda,
                   float* scale, int32_t* zp128, int64_t m0, int64_t m1, int bits) {
  const float qmin = act_qmin(bits), qmax = act_qmax(bits);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    uint8_t* ar = a + m * lda;
    float s;
    int zp = 0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) finite = finite && std::isfinite(xr[k]);
    if (!finite) {
      s = kNaN;  // Note [non-finite activation rows]
    } else if (symmetric) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
      s = symmetric_act_scale(amax, bits);
    } else {
      float lo = 0.f, hi = 0.f;  // the range always contains 0, so 0.0 maps to a code exactly
      for (int64_t k = 0; k < K; ++k) { lo = std::min(lo, xr[k]); hi = std::max(hi, xr[k]); }
      s = asymmetric_act_scale(lo, hi, &zp, bits);
    }
    const float fzp = (float)zp;
    for (int64_t k = 0; k < K; ++k) {
      // fmax / fmin return the number when one side is NaN: a non-finite row gets in-range codes.
      const float q = std::fmin(std::fmax(std::nearbyint(xr[k] / s + fzp), qmin), qmax);
      ar[k] = (uint8_t)((int)q + 128);
    }
    std::memset(ar + K, 0, lda - K);
    scale[m] = s;
    zp128[m] = 128 + zp;
  }
}

void weight_only(const WeightOnlyArgs& p, int64_t n0, int64_t n1) {
  scalar_linear(p.M, n0, n1, p.bias, p.out, p.ldo, [&](int64_t n, int64_t m) {
    const int8_t* wr = p.w + n * p.ldw;
    const float* xr = p.x + m * p.ldx;
    float acc = 0.f;
    for (int64_t gi = 0; gi < p.G; ++gi) {
      float part = 0.f;
      for (int64_t k = gi * p.g; k < (gi + 1) * p.g; ++k) part += xr[k] * (float)wr[k];
      acc += part * p.scale[n * p.G + gi];
    }
    return acc;
  });
}

void dynamic_act(const DynamicActArgs& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = p.w + n * p.ldw;
    int32_t rowsum = 0;
    for (int64_t k = 0; k < p.K; ++k) rowsum += wr[k];
    for (int64_t m = 0; m < p.M; ++m) {
      const uint8_t* ar = p.a + m * p.lda;
      int32_t acc = 0;
      for (int64_t k = 0; k < p.K; ++k) acc += (int32_t)ar[k] * (int32_t)wr[k];
      const int32_t dot = acc - p.a_zp128[m] * rowsum;
      p.out[m * p.ldo + n] = (float)dot * (p.a_scale[m] * p.w_scale[n]) + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

}  // namespace scalar

// ================================================================================================
// AVX2 + FMA (8 lanes): the dot kernels for every M, and an int16 panel kernel for the dynamic-activation
// prefill.
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

using V = Vec256;
#include "linear_int8_isa.h"

#include "int8_panel_loop.inc"  // run_panels, compiled for this level

// ---------------------------------------------------------------- dynamic activation, int16 panel kernel
// Note [AVX2 int8 prefill]: vpmaddubsw (u8 x s8 -> saturating int16 pairs) can't take the shifted codes
// a = q + 128 (0..255) against int8 weights exactly: 2 * 255 * 128 overflows int16. vpmaddwd on int16
// operands is exact (products sum into int32) and, at two per cycle, still does twice the multiply-adds of
// fp32 FMAs. So the weight is packed per call, 16 rows at a time, into k-pair panels [kc/2][16][2] int16
// (L2-sized), the activation is widened once per call to int16 by the glue (DynamicActArgs::a16), and a
// 6 x 16 register tile (12 int32 accumulators) streams over the panel, as the AVX-512 VNNI panel path does.
constexpr int64_t kPanelCols = 16;
// k per panel: 2048 pairs x 16 columns x 4 bytes = 128 KiB, in L2 (Note [panel k block] at DA_KC): 512 (an
// L1-sized panel) took 5% longer at M = 256 (K = N = 4096, thread CPU time).
constexpr int64_t kPanelKc = 4096;
constexpr int kPanelMr = 6;

// Rows [col, min(col + 16, n1)) x k [k0, k0 + kc) of w -> panel[kc/2][16] int16 pairs (missing rows and k
// zero); rowsum[0:16] += each row's sum of codes.
void pack_panel16(const DynamicActArgs& p, int64_t col, int64_t n1, int64_t k0, int64_t kc, int16_t* panel,
                  int32_t* rowsum) {
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t tail[16];
  for (int h = 0; h < 2; ++h) {
    __m256i rs = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < kc; kk += 16) {
      __m256i v[8];
      for (int r = 0; r < 8; ++r) {
        const int64_t row = col + 8 * h + r;
        if (row >= n1) { v[r] = _mm256_setzero_si256(); continue; }
        const int8_t* src = p.w + row * p.ldw + k0 + kk;
        if (kc - kk < 16) {
          std::memset(tail, 0, 16);
          std::memcpy(tail, src, kc - kk);
          src = tail;
        }
        v[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      }
      transpose8(v);  // v[c]: k-pair kk/2 + c of rows 8h .. 8h + 7
      const int64_t np = std::min<int64_t>(8, (kc - kk + 1) / 2);
      for (int64_t c = 0; c < np; ++c) {
        rs = _mm256_add_epi32(rs, _mm256_madd_epi16(v[c], ones));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (kk / 2 + c) * 2 * kPanelCols + 16 * h), v[c]);
      }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rowsum + 8 * h),
                        _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowsum + 8 * h)), rs));
  }
}

// c[R][16] (+)= a16[R rows, 2 np k] . panel. A function, not a lambda: Note [accumulators in registers].
template <int R>
void panel_micro(const int16_t* a, int64_t lda, const int16_t* panel, int64_t np, int32_t* c, bool first) {
  __m256i acc[R][2];
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 2; ++h)
      acc[m][h] = first ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 16 * m + 8 * h));
  for (int64_t q = 0; q < np; ++q) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 32));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 32 + 16));
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * q, 4);
      const __m256i av = _mm256_set1_epi32(pair);
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(av, b0));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(av, b1));
    }
  }
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 16 * m + 8 * h), acc[m][h]);
}

// The int16 panels for run_panels: k pairs, the activation codes widened by the glue (DynamicActArgs::a16).
struct Int16Panels {
  using Elem = int16_t;
  static constexpr int64_t kKc = kPanelKc;
  static constexpr int kMr = kPanelMr;
  static int64_t steps(int64_t kc) { return (kc + 1) / 2; }
  static const int16_t* codes(const DynamicActArgs& p) { return p.a16; }
  static void pack(const DynamicActArgs& p, int64_t col, int64_t n1, int64_t k0, int64_t kc, int16_t* panel,
                   int32_t* rowsum) {
    pack_panel16(p, col, n1, k0, kc, panel, rowsum);
  }
  template <int R>
  static void micro(const int16_t* a, int64_t lda, const int16_t* panel, int64_t np, int32_t* c, bool first) {
    panel_micro<R>(a, lda, panel, np, c, first);
  }
};

constexpr int64_t kDaPanelMinM = 16;  // below: the dot kernel

void dynamic_act(const DynamicActArgs& p, int64_t n0, int64_t n1) {
  if (p.a16 != nullptr && p.M >= kDaPanelMinM) return run_panels<Int16Panels>(p, n0, n1);
  da_dot(p, n0, n1);
}

}  // namespace avx2
#pragma GCC pop_options

// AVX-VNNI (VEX, and its EVEX form on ymm): the dynamic-activation prefill (Note [int8 x int8 prefill on AVX-VNNI]).
#define I8_NS avx_vnni
#define I8_TARGET _Pragma("GCC target(\"avx2,fma,f16c,avxvnni\")")
#define I8_DPBUSD _mm256_dpbusd_avx_epi32
#include "int8_panel_vnni256.inc"
#define I8_NS avx_vnni_evex
#define I8_TARGET _Pragma("GCC target(\"avx2,fma,f16c,avx512vl,avx512vnni\")")
#define I8_DPBUSD _mm256_dpbusd_epi32
#include "int8_panel_vnni256.inc"

// ================================================================================================
// AVX-512 F/BW/VL/DQ + VNNI (16 lanes): the dot kernels, and panel kernels for the prefill.
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace avx512 {

using V = Vec512;
#include "linear_int8_isa.h"

// Lane masks for the first n lanes (n may be <= 0 or past the vector width).
inline __mmask16 tail16(int64_t n) { return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
inline __mmask64 tail64(int64_t n) { return n <= 0 ? 0 : n >= 64 ? ~0ULL : ((1ULL << n) - 1); }

// In-register transpose of 16 rows x 16 lanes (32-bit lanes; int32 data goes through a cast).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit block b: rows 4i..4i+3 at lane 4b + c
    const __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d a2 = _mm512_castps_pd(t[4 * i + 2]), a3 = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    t[c + 8] = _mm512_shuffle_f32x4(u0, u2, 0xdd);
    t[c + 4] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(u1, u3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// ---------------------------------------------------------------- weight-only, panel kernel
constexpr int NR = 32;          // output columns per panel (2 zmm)
constexpr int MR = 6;           // activation rows per micro-tile: 12 accumulators
// k per fp32 panel: 1024 x 32 x 4 B = 256 KiB, in L2 (Note [panel k block] at DA_KC): 256 (an L1-sized
// panel) was 9% slower at M = 16 and 256 (K = N = 4096, thread CPU time, benchmarks/bench_int8_cpu_time.py).
constexpr int64_t WO_KC = 1024;
constexpr int64_t PANELS = 4;   // panels per block of columns (see *_block_rows)

// Panel [kc][32] fp32 of weight rows col0..col0+31 (rows >= n1 are zero), k in [k0, k0 + kc).
// Grouped weights (group size % 16 == 0) get their scale here; per-channel scales in the epilogue.
template <bool GROUPED>
void wo_pack(const WeightOnlyArgs& p, int64_t col0, int64_t n1, int64_t k0, int64_t kc, float* dst) {
  for (int h = 0; h < 2; ++h) {
    for (int64_t kk = 0; kk < kc; kk += 16) {
      const __mmask16 mk = tail16(kc - kk);
      __m512 v[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t row = col0 + 16 * h + r;
        if (row >= n1) { v[r] = _mm512_setzero_ps(); continue; }
        v[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, p.w + row * p.ldw + k0 + kk)));
        if (GROUPED) v[r] = _mm512_mul_ps(v[r], _mm512_set1_ps(p.scale[row * p.G + (k0 + kk) / p.g]));
      }
      transpose16(v);
      const int64_t nk = std::min<int64_t>(16, kc - kk);
      for (int64_t c = 0; c < nk; ++c) _mm512_storeu_ps(dst + (kk + c) * NR + 16 * h, v[c]);
    }
  }
}

// C[0:R, 0:32] (+)= A[0:R, 0:kc] @ panel. On the last k block: * per-channel scale + bias.
template <int R>
void wo_micro(const float* a, int64_t lda, const float* panel, int64_t kc, float* c, int64_t ldc,
              __mmask16 cm0, __mmask16 cm1, bool first, const float* colscale, const float* bias) {
  __m512 acc[R][2];
  for (int m = 0; m < R; ++m) {
    acc[m][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(cm0, c + m * ldc);
    acc[m][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(cm1, c + m * ldc + 16);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * NR), b1 = _mm512_loadu_ps(panel + k * NR + 16);
    for (int m = 0; m < R; ++m) {
      const __m512 av = _mm512_set1_ps(a[m * lda + k]);
      acc[m][0] = _mm512_fmadd_ps(av, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(av, b1, acc[m][1]);
    }
  }
  if (colscale) {
    const __m512 s0 = _mm512_maskz_loadu_ps(cm0, colscale), s1 = _mm512_maskz_loadu_ps(cm1, colscale + 16);
    for (int m = 0; m < R; ++m) {
      acc[m][0] = _mm512_mul_ps(acc[m][0], s0);
      acc[m][1] = _mm512_mul_ps(acc[m][1], s1);
    }
  }
  if (bias) {
    const __m512 b0 = _mm512_maskz_loadu_ps(cm0, bias), b1 = _mm512_maskz_loadu_ps(cm1, bias + 16);
    for (int m = 0; m < R; ++m) {
      acc[m][0] = _mm512_add_ps(acc[m][0], b0);
      acc[m][1] = _mm512_add_ps(acc[m][1], b1);
    }
  }
  for (int m = 0; m < R; ++m) {
    _mm512_mask_storeu_ps(c + m * ldc, cm0, acc[m][0]);
    _mm512_mask_storeu_ps(c + m * ldc + 16, cm1, acc[m][1]);
  }
}

template <bool GROUPED>
void wo_panel(const WeightOnlyArgs& p, int64_t n0, int64_t n1) {
  // Note [panel loop order]: each panel is packed right before every token uses it, so it is read from L2
  // while the activation block (M x kc) streams, and a thread holds one panel instead of all of its k
  // block's (MBs). Speed at M = 256 was the same either way (the micro-kernel is compute-bound).
  const int64_t npanels = (n1 - n0 + NR - 1) / NR;
  AlignedVector<float> buf(WO_KC * NR);
  for (int64_t k0 = 0; k0 < p.K; k0 += WO_KC) {
    const int64_t kc = std::min(WO_KC, p.K - k0);
    const bool first = k0 == 0, last = k0 + kc == p.K;
    for (int64_t j = 0; j < npanels; ++j) {
      const int64_t col = n0 + j * NR;
      wo_pack<GROUPED>(p, col, n1, k0, kc, buf.data());
      const __mmask16 cm0 = tail16(n1 - col), cm1 = tail16(n1 - col - 16);
      const float* cs = (last && !GROUPED) ? p.scale + col : nullptr;  // G == 1: scale is (N, 1)
      const float* bs = (last && p.bias) ? p.bias + col : nullptr;
      const float* panel = buf.data();
      for (int64_t m = 0; m < p.M; m += MR) {
        const float* a = p.x + m * p.ldx + k0;
        float* c = p.out + m * p.ldo + col;
        switch (std::min<int64_t>(MR, p.M - m)) {
          case 6: wo_micro<6>(a, p.ldx, panel, kc, c, p.ldo, cm0, cm1, first, cs, bs); break;
          case 5: wo_micro<5>(a, p.ldx, panel, kc, c, p.ldo, cm0, cm1, first, cs, bs); break;
          case 4: wo_micro<4>(a, p.ldx, panel, kc, c, p.ldo, cm0, cm1, first, cs, bs); break;
          case 3: wo_micro<3>(a, p.ldx, panel, kc, c, p.ldo, cm0, cm1, first, cs, bs); break;
          case 2: wo_micro<2>(a, p.ldx, panel, kc, c, p.ldo, cm0, cm1, first, cs, bs); break;
          default: wo_micro<1>(a, p.ldx, panel, kc, c, p.ldo, cm0, cm1, first, cs, bs); break;
        }
      }
    }
  }
}

constexpr int64_t kWoPanelMinM = 16;  // below: the dot kernel (measured with benchmarks/bench_linear.py)

bool wo_use_panel(const WeightOnlyArgs& p) {
  return p.M >= kWoPanelMinM && (p.G == 1 || p.g % 16 == 0);
}

void weight_only(const WeightOnlyArgs& p, int64_t n0, int64_t n1) {
  const bool grouped = p.G > 1;
  if (wo_use_panel(p)) {
    grouped ? wo_panel<true>(p, n0, n1) : wo_panel<false>(p, n0, n1);
  } else {
    grouped ? wo_dot<true>(p, n0, n1) : wo_dot<false>(p, n0, n1);
  }
}

// ---------------------------------------------------------------- dynamic activation, VNNI panel kernel
// k bytes per panel: 1024 int32 rows x 32 columns = 128 KiB, in L2.
// Note [panel k block]: the micro-kernel
// streams its panel at L2 speed about as fast as from L1, while every k block costs each micro-tile a load
// and store of its 12 int32 accumulators and a call; 1024 (an L1-sized panel) took 10% longer at M = 256
// (K = N = 4096: 22.9 -> 20.8 ms thread CPU time, 90% of this core's vpdpbusd peak; 5% at K = 11008).
constexpr int64_t DA_KC = 4096;

// Panel [kc/4][32][4] int8: lane j of row k4 holds w[col0 + j, k0 + 4*k4 .. +3] (rows >= n1 and k >= K
// are zero). Adds each column's sum of codes to rowsum[0:32].
void da_pack(const int8_t* w, int64_t ldw, int64_t col0, int64_t n1, int64_t k0, int64_t kc, int8_t* dst,
             int32_t* rowsum) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int h = 0; h < 2; ++h) {
    __m512i rs = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < kc; kk += 64) {
      const __mmask64 mk = tail64(kc - kk);
      __m512 v[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t row = col0 + 16 * h + r;
        v[r] = row < n1 ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(mk, w + row * ldw + k0 + kk))
                        : _mm512_setzero_ps();
      }
      transpose16(v);
      const int64_t nk4 = std::min<int64_t>(16, (kc - kk + 3) / 4);
      for (int64_t c = 0; c < nk4; ++c) {
        const __m512i q = _mm512_castps_si512(v[c]);
        rs = _mm512_dpbusd_epi32(rs, ones, q);
        _mm512_storeu_si512(dst + (kk / 4 + c) * 4 * NR + 64 * h, q);
      }
    }
    _mm512_storeu_si512(rowsum + 16 * h, _mm512_add_epi32(_mm512_loadu_si512(rowsum + 16 * h), rs));
  }
}

// int32 C[0:R, 0:32] (+)= A_u8[0:R, 0:4*k4n] @ panel, kept in the fp32 output's memory between k blocks;
// on the last block the epilogue turns it into floats: (C - zp128 * rowsum) * sa * sw + bias.
struct DaEpilogue {
  const float* a_scale;  // (R) or nullptr if not the last k block
  const int32_t* a_zp128;
  const float* w_scale;  // (32), masked
  const float* bias;     // (32) or nullptr
  const int32_t* rowsum; // (32)
  bool add_to_c = false; // the float result is added to C (group-wise scales: one call per group block)
};

// Rows [0, R) of int32 sums (the earlier k blocks' included) into C: as int32 while k blocks remain (ep.a_scale ==
// nullptr), else the float epilogue. Shared by the register tiles and the AMX tiles.
inline void da_store(const __m512i (*acc)[2], int R, float* c, int64_t ldc, __mmask16 cm0, __mmask16 cm1,
                     const DaEpilogue& ep) {
  if (!ep.a_scale) {
    for (int m = 0; m < R; ++m) {
      _mm512_mask_storeu_epi32(c + m * ldc, cm0, acc[m][0]);
      _mm512_mask_storeu_epi32(c + m * ldc + 16, cm1, acc[m][1]);
    }
    return;
  }
  const __m512i rs0 = _mm512_loadu_si512(ep.rowsum), rs1 = _mm512_loadu_si512(ep.rowsum + 16);
  const __m512 sw0 = _mm512_maskz_loadu_ps(cm0, ep.w_scale), sw1 = _mm512_maskz_loadu_ps(cm1, ep.w_scale + 16);
  const __m512 b0 = ep.bias ? _mm512_maskz_loadu_ps(cm0, ep.bias) : _mm512_setzero_ps();
  const __m512 b1 = ep.bias ? _mm512_maskz_loadu_ps(cm1, ep.bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < R; ++m) {
    const __m512i zp = _mm512_set1_epi32(ep.a_zp128[m]);
    const __m512 sa = _mm512_set1_ps(ep.a_scale[m]);
    const __m512i d0 = _mm512_sub_epi32(acc[m][0], _mm512_mullo_epi32(zp, rs0));
    const __m512i d1 = _mm512_sub_epi32(acc[m][1], _mm512_mullo_epi32(zp, rs1));
    const __m512 c0 = ep.add_to_c ? _mm512_add_ps(b0, _mm512_maskz_loadu_ps(cm0, c + m * ldc)) : b0;
    const __m512 c1 = ep.add_to_c ? _mm512_add_ps(b1, _mm512_maskz_loadu_ps(cm1, c + m * ldc + 16)) : b1;
    _mm512_mask_storeu_ps(c + m * ldc, cm0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(sa, sw0), c0));
    _mm512_mask_storeu_ps(c + m * ldc + 16, cm1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(sa, sw1), c1));
  }
}

template <int R>
void da_micro(const uint8_t* a, int64_t lda, const int8_t* panel, int64_t k4n, float* c, int64_t ldc,
              __mmask16 cm0, __mmask16 cm1, bool first, const DaEpilogue& ep) {
  __m512i acc[R][2];
  for (int m = 0; m < R; ++m) {
    acc[m][0] = first ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi32(cm0, c + m * ldc);
    acc[m][1] = first ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi32(cm1, c + m * ldc + 16);
  }
  for (int64_t k4 = 0; k4 < k4n; ++k4) {
    const __m512i b0 = _mm512_loadu_si512(panel + k4 * 4 * NR), b1 = _mm512_loadu_si512(panel + k4 * 4 * NR + 64);
    for (int m = 0; m < R; ++m) {
      int32_t a4;
      std::memcpy(&a4, a + m * lda + 4 * k4, 4);
      const __m512i av = _mm512_set1_epi32(a4);
      acc[m][0] = V::dot(acc[m][0], av, b0);
      acc[m][1] = V::dot(acc[m][1], av, b1);
    }
  }
  da_store(acc, R, c, ldc, cm0, cm1, ep);
}

// da_micro on the r (<= R) activation rows the tile has.
template <int R>
void da_micro_rows(int64_t r, const uint8_t* a, int64_t lda, const int8_t* panel, int64_t k4n, float* c, int64_t ldc,
                   __mmask16 cm0, __mmask16 cm1, bool first, const DaEpilogue& ep) {
  if constexpr (R > 1) {
    if (r < R) return da_micro_rows<R - 1>(r, a, lda, panel, k4n, c, ldc, cm0, cm1, first, ep);
  }
  da_micro<R>(a, lda, panel, k4n, c, ldc, cm0, cm1, first, ep);
}

constexpr int DA_MR = MR;  // 8 or 12 rows (16 / 24 accumulators) measured no faster

// Rows [0, R) of AMX int32 sums (amx_int8::sums) into C by da_store, the earlier k blocks' sums (kept in C) added
// unless `first`. Shared by the int8 and the int4 panel paths on AMX.
inline void da_store_sums(const int32_t (&sums)[32][32], int R, float* c, int64_t ldc, __mmask16 cm0, __mmask16 cm1,
                          bool first, const DaEpilogue& ep) {
  __m512i acc[32][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_load_si512(&sums[r][0]);
    acc[r][1] = _mm512_load_si512(&sums[r][16]);
    if (!first) {
      acc[r][0] = _mm512_add_epi32(acc[r][0], _mm512_maskz_loadu_epi32(cm0, c + r * ldc));
      acc[r][1] = _mm512_add_epi32(acc[r][1], _mm512_maskz_loadu_epi32(cm1, c + r * ldc + 16));
    }
  }
  da_store(acc, R, c, ldc, cm0, cm1, ep);
}

// Rows [m, m + rows) (rows <= 32, m a multiple of 32) of a panel's k block on the AMX tiles (Note [int8 panels on
// AMX]), from the packed codes.
void da_amx_rows(const DynamicActArgs& p, int64_t m, int rows, int64_t k0, const int8_t* panel, int64_t kc, float* c,
                 __mmask16 cm0, __mmask16 cm1, bool first, const DaEpilogue& ep, bool& configured) {
  alignas(64) int32_t sums[32][32];
  amx::configure(configured);
  const uint8_t* a = amx_int8::packed_block(p.a_amx, m, p.lda) + k0 / 64 * (amx::kBlockRows * 64);
  amx_int8::sums_rows(rows, a, 64, amx::kBlockRows * 64, panel, kc, sums);
  da_store_sums(sums, rows, c, p.ldo, cm0, cm1, first, ep);
}

void da_panel(const DynamicActArgs& p, int64_t n0, int64_t n1) {
  const int64_t npanels = (n1 - n0 + NR - 1) / NR;
  AlignedVector<int8_t> buf(DA_KC * NR);  // one panel at a time: Note [panel loop order]
  AlignedVector<int32_t> rowsum(npanels * NR, 0);
  const int64_t mr = p.a_amx ? amx::kBlockRows : DA_MR;
  bool amx_configured = false;
  for (int64_t k0 = 0; k0 < p.K; k0 += DA_KC) {
    const int64_t kc = std::min(DA_KC, p.K - k0), k4n = (kc + 3) / 4;
    const bool first = k0 == 0, last = k0 + kc == p.K;
    for (int64_t j = 0; j < npanels; ++j) {
      const int64_t col = n0 + j * NR;
      da_pack(p.w, p.ldw, col, n1, k0, kc, buf.data(), rowsum.data() + j * NR);
      const __mmask16 cm0 = tail16(n1 - col), cm1 = tail16(n1 - col - 16);
      const int8_t* panel = buf.data();
      for (int64_t m = 0; m < p.M; m += mr) {
        const uint8_t* a = p.a + m * p.lda + k0;
        DaEpilogue ep{nullptr, nullptr, nullptr, nullptr, rowsum.data() + j * NR};
        if (last) {
          ep.a_scale = p.a_scale + m;
          ep.a_zp128 = p.a_zp128 + m;
          ep.w_scale = p.w_scale + col;
          ep.bias = p.bias ? p.bias + col : nullptr;
        }
        float* c = p.out + m * p.ldo + col;
        const int rows = static_cast<int>(std::min<int64_t>(mr, p.M - m));
        if (p.a_amx) da_amx_rows(p, m, rows, k0, panel, kc, c, cm0, cm1, first, ep, amx_configured);
        else da_micro_rows<DA_MR>(rows, a, p.lda, panel, k4n, c, p.ldo, cm0, cm1, first, ep);
      }
    }
  }
  if (amx_configured) amx::release();
}

constexpr int64_t kDaPanelMinM = 8;  // below: the dot kernel (measured with benchmarks/bench_linear.py)

void dynamic_act(const DynamicActArgs& p, int64_t n0, int64_t n1) {
  p.M >= kDaPanelMinM ? da_panel(p, n0, n1) : da_dot(p, n0, n1);
}

}  // namespace avx512
#pragma GCC pop_options

// ================================================================================================
// AVX-512 + AVX512-BF16: the weight-only prefill with bf16 activations (Note [int8 weight-only in bf16])
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace avx512_bf16 {

// Note [int8 weight-only in bf16]: every int8 code (-128..127) is exact in bf16 (8 significant bits), so the
// panels of bf16_gemm.h hold the codes themselves and the row (or group) scale multiplies each segment's fp32
// sum: the products are exact and the sums fp32, the only rounding beyond the fp32 kernel's is the activations'
// own bf16. 32 codes (one 32-k step of a row) -> 32 bf16 in k order: two widenings to fp32, one vcvtne2ps2bf16.
__m512i codes_to_bf16(const int8_t* src, int64_t n) {
  const __m256i b = n >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                            : _mm256_maskz_loadu_epi8(n <= 0 ? 0u : (__mmask32)((1ull << n) - 1), src);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return bf16_gemm::to_bf16(lo, hi);
}

// Rows [b0, b0 + nb) x k [k0, k0 + kc) (kc a multiple of 32; codes past K read as 0) -> panel + segment scales.
void fill_panel(const WeightOnlyArgs& p, int64_t b0, int nb, int64_t k0, int64_t kc, int64_t seg, uint32_t* panel,
                float* sc) {
  for (int j0 = 0; j0 < bf16_gemm::kPanelCols; j0 += 16) {
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < nb ? codes_to_bf16(p.w + (b0 + j0 + i) * p.ldw + k, p.K - k) : _mm512_setzero_si512();
      bf16_gemm::store_pairs16(r, panel, (k - k0) / 2, j0);
    }
  }
  const int64_t nseg = (kc + seg - 1) / seg;
  for (int j = 0; j < bf16_gemm::kPanelCols; ++j)
    for (int64_t s = 0; s < nseg; ++s)
      sc[s * bf16_gemm::kPanelCols + j] = j < nb ? p.scale[(b0 + j) * p.G + (p.G == 1 ? 0 : (k0 + s * seg) / p.g)] : 0.f;
}

void weight_only(const WeightOnlyArgs& p, const uint16_t* xb, int64_t ldx, int planes, int64_t n0, int64_t n1) {
  const int64_t seg = bf16_gemm::segment_k(p.G, p.g);
  const bf16_gemm::PanelProblem pb{xb,    p.M,   ldx,    (p.K + 31) / 32 * 32, bf16_gemm::panel_block_k(seg), seg,
                                   p.out, p.ldo, p.bias, nullptr,              0,                             planes};
  bf16_gemm::panel_gemm(
      pb, n0, n1,
      [&](int64_t b0, int nb, int64_t k0, int64_t kc, uint32_t* panel, float* sc) {
        fill_panel(p, b0, nb, k0, kc, seg, panel, sc);
      },
      [](int64_t, int, float*) {});
}

}  // namespace avx512_bf16
#pragma GCC pop_options

}  // namespace

// ================================================================================================
// Dispatch
// ================================================================================================
// The weight-only panel micro-kernel, shared with linear_int4wo_tiled.cpp (see kernels.h).
void gemm_f32_6x32(int R, const float* a, int64_t lda, const float* panel, int64_t kc, float* c, int64_t ldc,
                   int ncols, bool first) {
  const __mmask16 cm0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
  const __mmask16 cm1 = ncols >= 32 ? (__mmask16)0xFFFF : ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
  switch (R) {
    case 6: return avx512::wo_micro<6>(a, lda, panel, kc, c, ldc, cm0, cm1, first, nullptr, nullptr);
    case 5: return avx512::wo_micro<5>(a, lda, panel, kc, c, ldc, cm0, cm1, first, nullptr, nullptr);
    case 4: return avx512::wo_micro<4>(a, lda, panel, kc, c, ldc, cm0, cm1, first, nullptr, nullptr);
    case 3: return avx512::wo_micro<3>(a, lda, panel, kc, c, ldc, cm0, cm1, first, nullptr, nullptr);
    case 2: return avx512::wo_micro<2>(a, lda, panel, kc, c, ldc, cm0, cm1, first, nullptr, nullptr);
    default: return avx512::wo_micro<1>(a, lda, panel, kc, c, ldc, cm0, cm1, first, nullptr, nullptr);
  }
}

// The VNNI panel pieces of the int8 dynamic-activation path, shared with linear_int8da_int4_packed.cpp (see kernels.h).
void pack_s8_panel(const int8_t* w, int64_t ldw, int64_t rows, int64_t kc, int8_t* dst, int32_t* rowsum) {
  avx512::da_pack(w, ldw, 0, rows, 0, kc, dst, rowsum);
}

TQK_AMX void gemm_u8s8_amx(int R, const uint8_t* a, int64_t lda, const int8_t* panel, int64_t kc, float* c,
                           int64_t ldc, int ncols, const float* a_scale, const int32_t* a_zp128, const float* w_scale,
                           const float* bias, const int32_t* rowsum, bool add_to_c, bool& configured) {
  alignas(64) int32_t sums[32][32];
  amx::configure(configured);
  amx_int8::sums_rows(R, a, lda, 64, panel, kc, sums);
  const avx512::DaEpilogue ep{a_scale, a_zp128, w_scale, bias, rowsum, add_to_c};
  avx512::da_store_sums(sums, R, c, ldc, avx512::tail16(ncols), avx512::tail16(ncols - 16), true, ep);
}

namespace {
bool cpu_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}
// vdpbf16ps (Intel Cooper Lake / Sapphire Rapids, AMD Zen 4): bf16 pairs dotted into fp32 lanes.
bool cpu_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_avx512_vnni() && __builtin_cpu_supports("avx512bf16");
}
// AMX tiles with bf16 and int8 dot products (Intel Sapphire Rapids and later), and Linux's permission to use their
// 8 KiB of state (asked once per process; a kernel without AMX support refuses it, and the level is then not run).
bool cpu_amx() {
  __builtin_cpu_init();
  if (!cpu_avx512_bf16() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
      !__builtin_cpu_supports("amx-int8"))
    return false;
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}
// F16C came with AVX2 on every CPU (Haswell, Zen); the AVX2 kernels read float16 scales with it.
bool cpu_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
}  // namespace

bool cpu_has_avx_vnni_vex() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return cpu_avx512_vnni();
    case Isa::kAvx512Bf16: return cpu_avx512_bf16();
    case Isa::kAmx: return cpu_amx();
    // The AVX-VNNI kernels also run as their EVEX encoding (the same instruction on ymm) where AVX-512 VNNI
    // is there instead (AMD Zen 4): see Note [AVX-VNNI kernels] in int4_packed_vec256.inc.
    case Isa::kAvxVnni: return cpu_avx2() && (cpu_has_avx_vnni_vex() || cpu_avx512_vnni());
    case Isa::kAvx2: return cpu_avx2();
    default: return true;
  }
}

Isa detected_isa() {
  if (cpu_amx()) return Isa::kAmx;
  if (cpu_avx512_bf16()) return Isa::kAvx512Bf16;
  if (cpu_avx512_vnni()) return Isa::kAvx512Vnni;
  if (cpu_avx2() && cpu_has_avx_vnni_vex()) return Isa::kAvxVnni;
  if (cpu_avx2()) return Isa::kAvx2;
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvxVnni: return "avx_vnni";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

void quantize_rows(Isa isa, const float* x, int64_t ldx, int64_t K, bool symmetric, uint8_t* a, int64_t lda,
                   float* scale, int32_t* zp128, int64_t m0, int64_t m1, int bits) {
  if (isa == Isa::kAvx512Vnni) return avx512::quantize_rows(x, ldx, K, symmetric, a, lda, scale, zp128, m0, m1, bits);
  if (isa == Isa::kAvx2 || isa == Isa::kAvxVnni)
    return avx2::quantize_rows(x, ldx, K, symmetric, a, lda, scale, zp128, m0, m1, bits);
  scalar::quantize_rows(x, ldx, K, symmetric, a, lda, scale, zp128, m0, m1, bits);
}

int64_t weight_only_block_rows(Isa isa, const WeightOnlyArgs& p) {
  if (isa == Isa::kAvx512Vnni && avx512::wo_use_panel(p)) return avx512::PANELS * avx512::NR;
  return 16;
}

void linear_weight_only(Isa isa, const WeightOnlyArgs& p, int64_t n0, int64_t n1) {
  switch (isa) {
    case Isa::kAvx512Vnni: return avx512::weight_only(p, n0, n1);
    case Isa::kAvx2: return p.G > 1 ? avx2::wo_dot<true>(p, n0, n1) : avx2::wo_dot<false>(p, n0, n1);
    default: return scalar::weight_only(p, n0, n1);
  }
}

bool weight_only_takes_bf16(const WeightOnlyArgs& p) {
  return p.M >= avx512::kWoPanelMinM && p.K > 0 && (p.G == 1 || p.g % 32 == 0);
}

void linear_weight_only_bf16(const WeightOnlyArgs& p, const uint16_t* xb, int64_t ldx, int planes, int64_t n0,
                             int64_t n1) {
  avx512_bf16::weight_only(p, xb, ldx, planes, n0, n1);
}

int64_t dynamic_act_block_rows(Isa isa, const DynamicActArgs& p) {
  if (isa == Isa::kAvx512Vnni && p.M >= avx512::kDaPanelMinM) return avx512::PANELS * avx512::NR;
  if (isa == Isa::kAvx2 && dynamic_act_wants_a16(isa, p.M)) return 8 * avx2::kPanelCols;
  if (isa == Isa::kAvxVnni && p.M >= avx2::kDaPanelMinM) return 8 * avx_vnni::kPanelCols;
  return 16;
}

bool dynamic_act_wants_a16(Isa isa, int64_t M) { return isa == Isa::kAvx2 && M >= avx2::kDaPanelMinM; }

bool dynamic_act_takes_amx(int64_t M) { return amx_selected() && M >= avx512::kDaPanelMinM; }

void linear_dynamic_act(Isa isa, const DynamicActArgs& p, int64_t n0, int64_t n1) {
  switch (isa) {
    case Isa::kAvx512Vnni: return avx512::dynamic_act(p, n0, n1);
    case Isa::kAvx2: return avx2::dynamic_act(p, n0, n1);
    case Isa::kAvxVnni:  // the AVX2 dot kernel below the panels' M (p.a16 is null at this level)
      if (p.M < avx2::kDaPanelMinM) return avx2::dynamic_act(p, n0, n1);
      return avx_vnni_vex_selected() ? avx_vnni::da_panel(p, n0, n1) : avx_vnni_evex::da_panel(p, n0, n1);
    default: return scalar::dynamic_act(p, n0, n1);
  }
}

}  // namespace torchqkit_cpu