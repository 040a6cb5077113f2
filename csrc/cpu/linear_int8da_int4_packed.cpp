// CPU backend of torchqkit::linear_int8da_int4_packed: int8 dynamic activation x int4 PackedIntxLayout weights,
// activations quantized per token inside the op, integer dot products (scalar, AVX2, AVX-VNNI, AVX-512 VNNI, AMX).
// The math: Note [int8 x int4 VNNI] below. The decode kernel is written once in int4_packed_dot.inc, compiled here
// for AVX-512 and through int4_packed_vec256.inc for the 256-bit levels, whose prefill is int4_packed_panel256.inc.
#include <ATen/ATen.h>
#include "parallel.h"
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "aligned_vector.h"
#include "amx_tiles.h"
#include "grouped_rows.h"
#include "kernel_descriptions.h"
#include "kernels.h"
#include "scale_dtype.h"
#include "simd.h"

namespace torchqkit_cpu {
namespace {

// ================================================================================================
// int8 dynamic activation x int4 PackedIntxLayout weights (torchqkit::linear_int8da_int4_packed).
//
// Note [int8 x int4 VNNI]: activations are quantized per token inside the op (quantize_rows, the
// oracle's numerics) to shifted codes a = qa + 128 with z = 128 + zero point, so x = (a - z) sa. A weight
// byte holds codes k = 2 i (low nibble) and 2 i + 1 (high nibble) as u = q + 8; with c = 8 + weight zero
// point (8 when symmetric), w = (u - c) s per group, and
//   y = sa * sum_groups s * [ sum_k (a - z) u  -  c * sum_k (a - z) ]   + bias
// The first sum is exact int32 per lane: 64 weight bytes (128 k) give two u8 x s8 vpdpbusd operands
// (low / high nibbles, 0..15) against the activation block permuted once per call to [even k | odd k];
// lane l covers k in [8 l, 8 l + 8), so it lies in one group when g % 8 == 0 and g divides 128 or 128
// divides g. The z * sum u part uses the weight's own lane sums (vpdpbusd with ones). The second sum is
// per (token, group): B[m][g] = sum_k a - z g, dotted with s * c per row.
// ================================================================================================
struct DaInt4Args {
  const uint8_t* ap;      // (M, lda) shifted codes, each 128-k block permuted to [even k | odd k] (the panel
                          // path: natural k order); 0 past K
  int64_t M, K, lda;
  const float* a_scale;   // (M); 1 when a_gscale is given
  const float* a_gscale;  // (M, G) the activation's scale per (token, weight group), or nullptr (Note [int8 x int4
                          // per-group activation scales])
  const int32_t* zp128;   // (M) 128 + activation zero point
  const float* bsum;      // (M, G) sum_k a - zp128 * g per group (nullptr where unused: lsum, the AVX-512 panel
                          // path without float zero points)
  const int32_t* lsum;    // (M, lda / 8) 8 * sum (a - zp128) over k in [8 j, 8 j + 8), k < K: the SIMD decode
                          // kernels with symmetric weights (Note [int8 x int4 decode]); nullptr otherwise
  const int32_t* zb;      // (ceil(K / kb), M) (-zpa, -B) int16 pairs per block and token, B = sum (a - zp128) over
                          // the block's k < K: the AVX-VNNI panels (Note [int8 x int4 prefill on AVX-VNNI, sums in
                          // registers]); nullptr otherwise
  const uint8_t* w;       // (N, ceil(K / 2)) packed nibbles, row stride ldw
  int64_t N, ldw;
  const void* scale;      // (N, G) contiguous, of type st
  SzType st;
  const int8_t* zp;       // (N, G) weight zero points or nullptr (symmetric)
  const void* zf;         // (N, G) float weight zero points of type st (w = (u - 8) s + z), or nullptr; the decode
                          // kernels take them, the glue adds them after the panel paths (Note [int8 x int4 float
                          // zero points])
  int64_t G, g;
  const float* bias;
  float* out;
  int64_t ldo;
};

// k per block of the prefill paths: a group, or 128 k of a larger group / of a per-channel row (a block never
// straddles two groups).
inline int64_t da_block_k(int64_t G, int64_t g) { return (G > 1 && g < 128) ? g : 128; }

// The zero term of the group at element off whose scale is s: s c (c = 8 + zero point, 8 when symmetric), or 8 s - z
// with float zero points (w = (u - 8) s + z). The SIMD stages (stage_run) compute the same by vectors.
inline float zero_term(const DaInt4Args& p, float s, int64_t off) {
  return p.zf ? 8.f * s - load_float(p.zf, p.st, off) : s * (8.f + (p.zp ? (float)p.zp[off] : 0.f));
}

// Row n's scales and zero terms as fp32 into srow[G], scrow[G].
void row_scales(const DaInt4Args& p, int64_t n, float* srow, float* scrow) {
  for (int64_t gi = 0; gi < p.G; ++gi) {
    const int64_t off = n * p.G + gi;
    srow[gi] = load_float(p.scale, p.st, off);
    scrow[gi] = zero_term(p, srow[gi], off);
  }
}

namespace scalar {
void da_int4(const DaInt4Args& p, int64_t n0, int64_t n1) {
  std::vector<float> srow(p.G), scrow(p.G);
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(p, n, srow.data(), scrow.data());
    const uint8_t* wr = p.w + n * p.ldw;
    for (int64_t m = 0; m < p.M; ++m) {
      const uint8_t* ar = p.ap + m * p.lda;
      float acc = 0.f;
      for (int64_t gi = 0; gi < p.G; ++gi) {
        int32_t e = 0;  // sum (a - z) u over the group, exact
        for (int64_t k = gi * p.g; k < (gi + 1) * p.g; ++k) {
          const int32_t u = (wr[k / 2] >> (4 * (k & 1))) & 0xF;
          const int64_t blk = k / 128, r = k % 128;
          const int32_t a = ar[blk * 128 + (r & 1) * 64 + r / 2];
          e += (a - p.zp128[m]) * u;
        }
        const float part = srow[gi] * (float)e - scrow[gi] * p.bsum[m * p.G + gi];
        acc += p.a_gscale ? p.a_gscale[m * p.G + gi] * part : part;
      }
      p.out[m * p.ldo + n] = p.a_scale[m] * acc + (p.bias ? p.bias[n] : 0.f);
    }
  }
}
}  // namespace scalar

// The packed nibbles the next panel of a prefill expands (rows x lines_per_row cache lines, rows ldw apart), fetched
// into L2 a few lines per block while this panel's tiles run (the AVX-512 and AVX-VNNI register-sum prefills).
// Without it the AVX-512 expand_block waited on its loads: 14% of the op's cycles at 4096^2, M = 256, one thread
// (perf record), 5% with it; 12.0 -> 11.1 ms a call.
struct NextPanel {
  const uint8_t* w = nullptr;
  int64_t ldw = 0, lines_per_row = 1, lines = 0;
  // Bounds as plain values: with `l < std::min(l1, lines)` GCC 12 deleted the whole loop (checked in the object code).
  void fetch(int64_t l0, int64_t l1) const {
    const int64_t end = l1 < lines ? l1 : lines;
    for (int64_t l = l0 > 0 ? l0 : 0; l < end; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(w + l / lines_per_row * ldw + l % lines_per_row * 64), _MM_HINT_T1);
  }
};

// After the panel of rows [col, col + cols) that ends at k `end`: the same rows' next k range (panels of kcmax k), else
// the next `cols` rows' first if this thread has them (more_rows), else nothing.
inline NextPanel next_panel(const DaInt4Args& p, int64_t col, int64_t cols, int64_t end, int64_t kcmax,
                            bool more_rows) {
  const int64_t k0 = end < p.K ? end : 0, row = k0 > 0 ? col : col + cols;
  if (k0 == 0 && !more_rows) return NextPanel{};
  const int64_t lpr = ((std::min(kcmax, p.K - k0) + 1) / 2 + 63) / 64;
  return NextPanel{p.w + row * p.ldw + k0 / 2, p.ldw, lpr, std::min(cols, p.N - row) * lpr};
}

// The 256-bit levels of the decode kernel (int4_packed_vec256.inc).
#define DA4_NS avx2
#define DA4_TARGET _Pragma("GCC target(\"avx2,fma,f16c\")")
#include "int4_packed_vec256.inc"
#define DA4_NS avx_vnni
#define DA4_TARGET _Pragma("GCC target(\"avx2,fma,f16c,avxvnni\")")
#define DA4_DPBUSD256 _mm256_dpbusd_avx_epi32
#define DA4_DPBUSD_ASM "%{vex%} vpdpbusd %2, %1, %0"  // %{ %}: braces, not asm dialect alternatives
#define DA4_DPWSSD256 _mm256_dpwssd_avx_epi32
#include "int4_packed_vec256.inc"
#define DA4_NS avx_vnni_evex
#define DA4_TARGET _Pragma("GCC target(\"avx2,fma,f16c,avx512vl,avx512vnni\")")
#define DA4_DPBUSD256 _mm256_dpbusd_epi32
#define DA4_DPBUSD_ASM "vpdpbusd %2, %1, %0"
#define DA4_DPWSSD256 _mm256_dpwssd_epi32
#include "int4_packed_vec256.inc"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace avx512 {

inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {  // in place, see linear_int8.cpp
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

struct DaVec : Vec512 {  // the decode kernel's operations on zmm (int4_packed_dot.inc; float ones: simd.h's Vec512)
  static constexpr int W = 64;
  static constexpr int kMaxMB = 4;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I load_n(const uint8_t* p, int64_t nb) {  // bytes [0, nb) (nb may be <= 0 or >= 64), zero above
    return _mm512_maskz_loadu_epi8(nb >= 64 ? ~0ULL : nb <= 0 ? 0ULL : (1ULL << nb) - 1, p);
  }
  static I lo_nibbles(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static I hi_nibbles(I w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  static I vec_dot(I lo, I hi, const uint8_t* ae, const uint8_t* ao) {
    return dpbusd(dpbusd(_mm512_setzero_si512(), lo, load(ae)), hi, load(ao));
  }
  static I block_dot(const I (&lo)[1], const I (&hi)[1], const uint8_t* a) { return vec_dot(lo[0], hi[0], a, a + 64); }
  static I add_b(I a, I b) { return _mm512_add_epi8(a, b); }
  static I set1_b(int8_t v) { return _mm512_set1_epi8(v); }
  // acc + per-lane sums of uu (unsigned bytes <= 60) times z (signed bytes).
  static I usum_dot(I acc, I uu, I z) { return dpbusd(acc, uu, z); }
  static constexpr bool kZeroTermInSums = false;  // with_zero_term (int4_packed_dot.inc) adds usum_dot's vpdpbusd
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F lane_scales(const float* s, I lane_group) { return _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(s)); }
  static F load_scales(const void* base, SzType t, int64_t off) {  // 16 scales at element off
    switch (t) {
      case SzType::kF32: return _mm512_loadu_ps(static_cast<const float*>(base) + off);
      case SzType::kBF16: {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      default:
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + off)));
    }
  }
  static F codes_plus8(const int8_t* zp) {  // 8 + zp for 16 int8 zero points
    const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(zp));
    return _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(z)), _mm512_set1_ps(8.f));
  }
};

#include "int4_packed_dot.inc"

// Note [int8 x int4 prefill]: from kDaInt4PanelMinM tokens the nibbles of 32 rows x one block of k (a
// group, or 128 k of a larger group / a per-channel row) are expanded once to int8 q = u - c and packed into
// the VNNI panel layout of the int8 x int8 path (pack_s8_panel), block after block over a panel of k; 6-token x
// 32-row tiles of vpdpbusd multiply it with every token's shifted codes (Note [int8 x int4 prefill, group sums in
// registers]). The activation is in natural k order, stored block-major by the glue ([k block][token][k in block]:
// rows 4 KiB apart thrashed L1), see Note [int8 x int4 prefill on 256 bits].
// Below: da_int4 above. At M = 12 the panels won on every shape timed (the op alone, 2 threads, Zen 5: 4096 x 11008
// 2.5 -> 1.9 ms, 576 x 1536 g32 0.093 -> 0.075 ms); at M = 8-11 the decode kernel still won on some (1536 x 576 g32).
constexpr int64_t kDaInt4PanelMinM = 12;

// tmp[r][0:kc] = q of rows col + r (r < rows), k in [k0, k0 + kc): 64 codes per step from 32 bytes.
void expand_block(const DaInt4Args& p, int64_t col, int64_t rows, int64_t k0, int64_t kc, int8_t* tmp, int64_t ldt) {
  const int64_t gi = k0 / p.g, row_bytes = (p.K + 1) / 2;
  const __m512i lo4 = _mm512_set1_epi16(0x000F), hi4 = _mm512_set1_epi16(0x0F00);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = col + r;
    const uint8_t* wr = p.w + n * p.ldw + k0 / 2;
    const __m512i c = _mm512_set1_epi8((char)(8 + (p.zp ? p.zp[n * p.G + gi] : 0)));
    for (int64_t kk = 0; kk < kc; kk += 64) {
      const int64_t nb = std::min<int64_t>(32, std::min((kc - kk + 1) / 2, row_bytes - (k0 + kk) / 2));
      const __m256i b = _mm256_maskz_loadu_epi8(nb >= 32 ? ~0u : ((1u << nb) - 1), wr + kk / 2);
      const __m512i w16 = _mm512_cvtepu8_epi16(b);
      const __m512i u = _mm512_or_si512(_mm512_and_si512(w16, lo4), _mm512_and_si512(_mm512_slli_epi16(w16, 4), hi4));
      const __mmask64 mk = kc - kk >= 64 ? ~0ULL : ((1ULL << (kc - kk)) - 1);
      _mm512_mask_storeu_epi8(tmp + r * ldt + kk, mk, _mm512_sub_epi8(u, c));
    }
  }
}

// Note [int8 x int4 prefill, group sums in registers]: the 6x32 tile keeps its int32 sums of one block (kb k) in 12
// zmm and folds them into 12 fp32 accumulators at the block's end, f += float(d) s_w (s_w s_a with per-group
// activation scales), so a tile runs over a whole panel of kDaInt4Kc k with one load and one store of its outputs.
// (Storing each block's scaled sums into the fp32 output and loading them for the next block, as the AMX path still
// does, cost 4096^2 at M = 256 8.7 ms against the int8 x int8 panels' 5.0 ms, benchmarks/bench_linear.py on a Zen 5;
// at M = 16-64 it also lost, 4096 x 11008 at M = 32 4.4 against 3.0 ms, the op alone.) The activation's shift (codes
// a = q + zp128) leaves d = sum_k a w - zp128 rowsum exact in int32: each block's sums start at -zp128 rowsum by one
// vpdpwssd (|rowsum| <= 128 x 15 fits its int16 halves), not at zero.
// Subtracting zp128 sum_b s_b rowsum_b once in fp32 instead cancels two large sums: with asymmetric weights (a
// rowsum of 128 x 7.5 per block) it missed the reference's tolerance at K = 4608.
constexpr int64_t kDaInt4Kc = 4096;  // k per panel: 32 x 4096 int8 = 128 KiB, in L2 (as the int8 path's DA_KC)

struct GroupPanel {
  const int8_t* codes;   // [kc / 4][32][4]: block b's k-quads from row b kb / 4 (pack_s8_panel per block)
  const float* sw;       // [nb][32] each block's weight scales
  const int32_t* rs;     // [nb][32] each block's code sums; where every token's zp128 is 128 (symmetric activations),
                         // -128 x them: the sums' start, one vector for all tokens
  int64_t nb, kb;
};

// One tile's tokens [m, m + R) against a panel.
struct GroupTile {
  const uint8_t* a;  // the tokens' codes in the panel's first block: token stride kb, block stride a_bs
  int64_t a_bs;
  const int32_t* zp128;   // (R) the tokens' shifts
  const float* a_scale;   // (R) their scales (nullptr with per-group scales)
  const float* sag;       // their scales per group (token stride G) or nullptr; block b of the panel is in group
  int64_t G, b0, bpg;     // (b0 + b) / bpg
  float* c;               // (R, 32) at row stride ldc: the fp32 sums of the earlier panels unless `first`; with
  int64_t ldc;            // `last`, c = s_a f + bias (s_a = 1 with per-group scales), else f as it is
  __mmask16 cm0, cm1;
  bool first, last;
  const float* bias;      // (32) or nullptr
  int64_t pf0, pfn;       // block b fetches lines [pf0 + b pfn, pf0 + (b + 1) pfn) of the next panel
};

template <int R, bool GA, bool Z128>
void grouped_micro(const GroupPanel& gp, const GroupTile& t, const NextPanel& next) {
  __m512 f[R][2];
  for (int m = 0; m < R; ++m) {
    f[m][0] = t.first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(t.cm0, t.c + m * t.ldc);
    f[m][1] = t.first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(t.cm1, t.c + m * t.ldc + 16);
  }
  const int64_t kb = gp.kb, k4n = kb / 4;
  for (int64_t b = 0; b < gp.nb; ++b) {
    next.fetch(t.pf0 + b * t.pfn, t.pf0 + (b + 1) * t.pfn);
    __m512i acc[R][2];
    const __m512i r0 = _mm512_load_si512(gp.rs + 32 * b), r1 = _mm512_load_si512(gp.rs + 32 * b + 16);
    for (int m = 0; m < R; ++m) {
      if constexpr (Z128) {
        acc[m][0] = r0;
        acc[m][1] = r1;
      } else {  // -zp128 x rowsum in the low int16 halves (the high halves times zero)
        const __m512i z = _mm512_set1_epi32((uint16_t)(-t.zp128[m]));
        acc[m][0] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), z, r0);
        acc[m][1] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), z, r1);
      }
    }
    const int8_t* w = gp.codes + b * kb * 32;
    const uint8_t* ab = t.a + b * t.a_bs;
    for (int64_t k4 = 0; k4 < k4n; ++k4) {
      const __m512i w0 = _mm512_load_si512(w + k4 * 128), w1 = _mm512_load_si512(w + k4 * 128 + 64);
      for (int m = 0; m < R; ++m) {
        int32_t a4;
        std::memcpy(&a4, ab + m * kb + 4 * k4, 4);
        const __m512i av = _mm512_set1_epi32(a4);
        acc[m][0] = dpbusd(acc[m][0], av, w0);
        acc[m][1] = dpbusd(acc[m][1], av, w1);
      }
    }
    const __m512 s0 = _mm512_load_ps(gp.sw + 32 * b), s1 = _mm512_load_ps(gp.sw + 32 * b + 16);
    for (int m = 0; m < R; ++m) {
      __m512 t0 = s0, t1 = s1;
      if constexpr (GA) {
        const __m512 sa = _mm512_set1_ps(t.sag[m * t.G + (t.b0 + b) / t.bpg]);
        t0 = _mm512_mul_ps(s0, sa);
        t1 = _mm512_mul_ps(s1, sa);
      }
      f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), t0, f[m][0]);
      f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][1]), t1, f[m][1]);
    }
  }
  if (t.last) {
    const __m512 bb0 = t.bias ? _mm512_maskz_loadu_ps(t.cm0, t.bias) : _mm512_setzero_ps();
    const __m512 bb1 = t.bias ? _mm512_maskz_loadu_ps(t.cm1, t.bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) {
      const __m512 sa = _mm512_set1_ps(GA ? 1.f : t.a_scale[m]);
      f[m][0] = _mm512_fmadd_ps(f[m][0], sa, bb0);
      f[m][1] = _mm512_fmadd_ps(f[m][1], sa, bb1);
    }
  }
  for (int m = 0; m < R; ++m) {
    _mm512_mask_storeu_ps(t.c + m * t.ldc, t.cm0, f[m][0]);
    _mm512_mask_storeu_ps(t.c + m * t.ldc + 16, t.cm1, f[m][1]);
  }
}

template <bool GA, bool Z128, int R = 6>
void grouped_tile(int rows, const GroupPanel& gp, const GroupTile& t, const NextPanel& next) {
  if constexpr (R > 1) {
    if (rows < R) return grouped_tile<GA, Z128, R - 1>(rows, gp, t, next);
  }
  grouped_micro<R, GA, Z128>(gp, t, next);
}

inline __mmask16 cols_mask(int64_t n) { return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// The 6x32 register tiles over panels of kDaInt4Kc k (Note [int8 x int4 prefill, group sums in registers]).
void da_int4_prefill_regs(const DaInt4Args& p, int64_t j0, int64_t j1) {
  const int64_t kb = da_block_k(p.G, p.g), kcmax = std::min(p.K + kb - 1, kDaInt4Kc) / kb * kb;
  const int64_t nbmax = kcmax / kb, bpg = p.G == 1 ? 1 : std::max<int64_t>(1, p.g / kb);
  // One buffer, on cache lines, the thread's, kept across calls (every byte read is written first): the panel's
  // codes, then the blocks' scales and code sums.
  thread_local AlignedVector<uint8_t> buf;
  const size_t need = (size_t)(kcmax * 32 + 2 * nbmax * 128);
  if (buf.size() < need) buf.resize(need);
  int8_t* const codes = reinterpret_cast<int8_t*>(buf.data());
  float* const sw = reinterpret_cast<float*>(codes + kcmax * 32);
  int32_t* const rs = reinterpret_cast<int32_t*>(sw + nbmax * 32);
  alignas(64) int8_t tmp[32 * 128];
  const int64_t ntiles = (p.M + 5) / 6;
  // Every token's codes shifted by 128 (symmetric activations): the blocks' sums start at -128 rowsum for all of them,
  // no vpdpwssd per token and block (groups of 32, M = 256: 4096^2 7.1 -> 6.5 ms, 576 x 1536 0.40 -> 0.35 ms).
  bool z128 = true;
  for (int64_t m = 0; m < p.M; ++m) z128 = z128 && p.zp128[m] == 128;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t col = 32 * j, rows = std::min<int64_t>(32, p.N - col);
    const __mmask16 cm0 = cols_mask(rows), cm1 = cols_mask(rows - 16);
    for (int64_t k0 = 0; k0 < p.K; k0 += kcmax) {
      const int64_t kc = std::min(kcmax, p.K - k0), nb = (kc + kb - 1) / kb;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t kk = k0 + b * kb, kn = std::min(kb, p.K - kk), gi = p.G == 1 ? 0 : kk / p.g;
        int8_t* dst = codes + b * kb * 32;
        if (kn < kb) std::memset(dst, 0, kb * 32);  // the last block of a per-channel row: zero codes past K
        expand_block(p, col, rows, kk, kn, tmp, 128);
        std::memset(rs + 32 * b, 0, 128);
        pack_s8_panel(tmp, 128, rows, kn, dst, rs + 32 * b);
        if (z128)
          for (int64_t r = 0; r < 32; ++r) rs[32 * b + r] *= -128;
        for (int64_t r = 0; r < 32; ++r)
          sw[32 * b + r] = r < rows ? load_float(p.scale, p.st, (col + r) * p.G + gi) : 0.f;
      }
      const NextPanel next = next_panel(p, col, 32, k0 + kc, kcmax, j + 1 < j1);
      const int64_t pfn = (next.lines + ntiles * nb - 1) / (ntiles * nb);  // lines per block, spread over the tiles
      const GroupPanel gp{codes, sw, rs, nb, kb};
      GroupTile t{};
      t.a_bs = p.M * kb;
      t.G = p.G;
      t.b0 = k0 / kb;  // the panel's first block
      t.bpg = bpg;
      t.ldc = p.ldo;
      t.cm0 = cm0;
      t.cm1 = cm1;
      t.first = k0 == 0;
      t.last = k0 + kc >= p.K;
      t.bias = p.bias ? p.bias + col : nullptr;
      t.pfn = pfn;
      for (int64_t m = 0; m < p.M; m += 6) {
        t.a = p.ap + (t.b0 * p.M + m) * kb;
        t.zp128 = p.zp128 + m;
        t.a_scale = p.a_gscale ? nullptr : p.a_scale + m;
        t.sag = p.a_gscale ? p.a_gscale + m * p.G : nullptr;
        t.c = p.out + m * p.ldo + col;
        t.pf0 = m / 6 * nb * pfn;
        const int R = (int)std::min<int64_t>(6, p.M - m);
        if (p.a_gscale) grouped_tile<true, true>(R, gp, t, next);  // per-group scales: symmetric, zp128 = 128
        else if (z128) grouped_tile<false, true>(R, gp, t, next);
        else grouped_tile<false, false>(R, gp, t, next);
      }
    }
  }
}

// The amx level: one block (kb k, whole 64-k steps) at a time on the AMX-INT8 tiles, 32 tokens per tile, each block's
// scaled sums added into the fp32 output (Note [int8 panels on AMX]).
void da_int4_prefill_amx(const DaInt4Args& p, int64_t j0, int64_t j1) {
  const int64_t kb = da_block_k(p.G, p.g);
  bool configured = false;
  alignas(64) int8_t tmp[32 * 128];
  alignas(64) int8_t panel[32 * 128];
  alignas(64) float ws[32];
  alignas(64) int32_t rowsum[32];
  alignas(64) float sa[32];  // a block's per-(token, group) activation scales (a_gscale)
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t col = 32 * j, rows = std::min<int64_t>(32, p.N - col);
    for (int64_t k0 = 0; k0 < p.K; k0 += kb) {
      const int64_t kc = std::min(kb, p.K - k0), gi = p.G == 1 ? 0 : k0 / p.g;
      expand_block(p, col, rows, k0, kc, tmp, 128);
      std::memset(rowsum, 0, sizeof(rowsum));
      pack_s8_panel(tmp, 128, rows, kc, panel, rowsum);
      for (int64_t r = 0; r < rows; ++r) ws[r] = load_float(p.scale, p.st, (col + r) * p.G + gi);
      const bool last = k0 + kc >= p.K;
      for (int64_t m = 0; m < p.M; m += 32) {
        const int R = (int)std::min<int64_t>(32, p.M - m);
        const uint8_t* a = p.ap + (k0 / kb) * p.M * kb + m * kb;
        float* c = p.out + m * p.ldo + col;
        const float* bias = last && p.bias ? p.bias + col : nullptr;
        const float* as = p.a_scale + m;
        if (p.a_gscale) {
          for (int r = 0; r < R; ++r) sa[r] = p.a_gscale[(m + r) * p.G + gi];
          as = sa;
        }
        gemm_u8s8_amx(R, a, kb, panel, kc, c, p.ldo, (int)rows, as, p.zp128 + m, ws, bias, rowsum, k0 > 0, configured);
      }
    }
  }
  if (configured) amx::release();
}

void da_int4_prefill(const DaInt4Args& p, int64_t j0, int64_t j1, bool amx) {
  amx ? da_int4_prefill_amx(p, j0, j1) : da_int4_prefill_regs(p, j0, j1);
}

}  // namespace avx512
#pragma GCC pop_options

// From here the 256-bit levels take the panel GEMM (Note [int8 x int4 prefill on 256 bits]), below it the decode
// kernel (measured with benchmarks/bench_linear.py).
constexpr int64_t kDaInt4Panel256MinM = 16;
// Lane sums (DaInt4Args::lsum) are half the bytes of the activation codes: for 8 tokens of 4096 k the two no
// longer fit L1 beside the weight stream (M = 8, 4096^2, one thread: 15% slower than per-group sums, measured
// with benchmarks/bench_int8da_int4_decode.py); up to 4 tokens the lane sums are faster (no per-row work).
constexpr int64_t kDaInt4LaneSumMaxM = 4;

// Note [int8 x int4 float zero points]: GGUF's Q4_1 stores w = d q + m per 32 weights (q = 0..15, a float
// minimum m). An integer zero point can't hold m / d in general: requantized with one, SmolLM2's Q4_1 weights move and
// its perplexity over 128 tokens is 1.41x the float model's, where float zero points in float16 reproduce the file's
// weights (to float16's rounding of z) and give 1.14x (test/api/test_int8_act_groups.py). With
// u = q + 8 as stored, w = (u - 8) s + z, so per group sum_k a w = s sum_k a u - (8 s - z) sum_k a: the decode
// kernels stage 8 s - z where integer zero points give s c (stage_scales, row_scales), and the per-group sums of
// the activation codes (bsum) do the rest as before. The panel paths expand u - 8 to int8 (no zero point); the
// glue then adds sum_g z (activation scale x bsum) as one (M, G) x (G, N) matmul, a small fraction of a prefill.
//
// Note [int8 x int4 per-group activation scales]: act_group_size = the weight's group size quantizes each token's
// groups symmetrically with their own scale (llama.cpp's Q8_1 blocks: outlier features no longer set the step of the
// whole token). A group's integer dot product is scaled by s_w s_a instead of s_w; the decode kernels fold each
// token's s_a into its copy of the staged weight scales (stage_scales, with the group scales tiled over a stage's rows
// so the stage stays one vector loop), so a token costs the same as with one scale; the panel paths take s_a per
// block in their epilogues (blocks never straddle groups). Activations are symmetric then: every zero point is 0.

at::Tensor linear_int8da_int4_packed(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                                     const std::optional<at::Tensor>& zero_point,
                                     const std::optional<at::Tensor>& bias, bool act_symmetric, int64_t act_group_size,
                                     int64_t act_bits) {
  constexpr const char* op = "torchqkit::linear_int8da_int4_packed";
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": activations must be float32, bfloat16 or float16, got ", dt);
  // int4 activation codes (W4A4) are int8 codes of a smaller range: the same kernels sum them (Note [int8 x int4
  // VNNI]), only quantize_rows' range differs
  TORCH_CHECK(act_bits == 8 || act_bits == 4, op, ": act_bits must be 8 or 4, got ", act_bits);
  const int bits = static_cast<int>(act_bits);
  const int64_t K = x.size(-1);
  TORCH_CHECK(qdata.dim() == 2 && qdata.scalar_type() == at::kByte && qdata.size(1) == (K + 1) / 2 &&
                  qdata.stride(1) == 1, op, ": qdata must be uint8 (N, ceil(K / 2)) = (N, ", (K + 1) / 2,
              ") with unit column stride, got ", qdata.scalar_type(), " ", qdata.sizes());
  const int64_t N = qdata.size(0);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) >= 1 && K % scale.size(1) == 0, op,
              ": scale must be (N, K / group_size) with the group size dividing K = ", K, ", got ", scale.sizes());
  const int64_t G = scale.size(1), g = K / G;
  TORCH_CHECK(G == 1 || (g % 8 == 0 && (128 % g == 0 || g % 128 == 0)), op, ": group size ", g,
              " is not supported (per channel, or a multiple of 8 that divides 128 or that 128 divides)");
  TORCH_CHECK(K < (1 << 16), op, ": K = ", K, " could overflow the int32 accumulator (limit 65535)");
  TORCH_CHECK(act_group_size == 0 || (act_group_size == g && G > 1 && act_symmetric), op, ": act_group_size ",
              act_group_size, " must be 0 (one activation scale per token) or the weight's group size ", g,
              " with symmetric activations (act_symmetric=True)");
  const at::Tensor s = scale.contiguous();
  at::Tensor zw, zf;  // integer zero point codes, or float zero points (w = (u - 8) s + z) in the scales' dtype
  if (zero_point.has_value()) {
    TORCH_CHECK(zero_point->sizes() == scale.sizes(), op, ": zero_point must be shaped like scale ", scale.sizes(),
                ", got ", zero_point->sizes());
    if (at::isFloatingType(zero_point->scalar_type()))
      zf = zero_point->to(s.scalar_type()).contiguous();
    else
      zw = zero_point->to(at::kChar).contiguous();  // int4 zero points: no copy when stored as int8
  }
  const at::Tensor x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape (", N, "), got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x2.size(0), lda = (K + 127) / 128 * 128;
  at::Tensor out = at::empty({M, N}, x2.options());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  if (M == 0 || N == 0) return out.to(dt).reshape(shape);
  const Isa isa = selected_isa_level();
  const bool wide = isa == Isa::kAvx2 || isa == Isa::kAvxVnni;  // 256-bit levels
  const bool panel = isa == Isa::kAvx512Vnni && M >= avx512::kDaInt4PanelMinM;
  const bool panel256 = wide && M >= kDaInt4Panel256MinM;
  const int64_t kb = da_block_k(G, g);
  // The SIMD decode kernels with symmetric weights subtract lane sums of the activation (lsum) up to
  // kDaInt4LaneSumMaxM tokens, the other paths per-group sums (bsum); the register-sum panel paths neither (Note
  // [int8 x int4 prefill, group sums in registers], Note [int8 x int4 prefill on AVX-VNNI, sums in registers]).
  const bool lanes = !panel && !panel256 && isa != Isa::kScalar && !zw.defined() && !zf.defined() &&
                     M <= kDaInt4LaneSumMaxM;
  // Float zero points: the decode kernels stage them with the scales; after the panel paths (which expand u - 8)
  // the glue adds sum_g z (activation scale x group sum) as one small matmul (Note [int8 x int4 float zero points]).
  const bool zf_after = zf.defined() && (panel || panel256);
  const bool ga = act_group_size > 0;
  // The AVX-512 panel path reads the unsigned codes in natural k order (Note [int8 x int4 prefill]); the 256-bit
  // panel path signed codes in natural order (Note [int8 x int4 prefill on 256 bits]); the decode kernels signed
  // codes permuted per 128-k block (Note [int8 x int4 decode]); scalar unsigned codes, permuted.
  // One scratch buffer, the calling thread's, kept across calls (an allocation was a fixed cost of every decode
  // call): a, ap (M, lda) codes; a_scale, zp (M); the activation's group scales (M, G) when ga; bsum or lsum.
  const auto al64 = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t o_ap = al64(M * lda), o_as = o_ap + al64(M * lda), o_zp = o_as + al64(4 * M),
                o_ga = o_zp + al64(4 * M), o_s = o_ga + (ga ? al64(4 * M * G) : 0);
  // bsum: the decode kernels and the AVX2 panels; the register-sum panels (AVX-512, AVX-VNNI) only for the float zero
  // points (the AVX-VNNI ones sum their blocks themselves)
  const bool vnni256 = panel256 && isa == Isa::kAvxVnni, regs = panel || vnni256;
  const bool sums = !lanes && (!regs || zf_after);
  const int64_t sums_bytes = lanes ? 4 * M * (lda / 8) : sums ? 4 * M * G : 0;
  const int64_t o_zb = o_s + al64(sums_bytes), zb_bytes = vnni256 ? 4 * M * ((K + kb - 1) / kb) : 0;
  // AMX tiles read 16 rows of a block's codes from the last 16-row half's first row: up to 15 rows past the end
  const bool amx = panel && amx_selected() && kb % 64 == 0;
  const int64_t slack = amx ? 16 * kb : 0;
  thread_local AlignedVector<uint8_t> scratch;
  const size_t need = (size_t)(o_zb + zb_bytes + slack);
  if (scratch.size() < need) scratch.resize(need);
  uint8_t* const a = scratch.data();
  uint8_t* const ap = a + o_ap;
  float* const a_scale = reinterpret_cast<float*>(a + o_as);
  int32_t* const zp = reinterpret_cast<int32_t*>(a + o_zp);
  float* const a_gscale = ga ? reinterpret_cast<float*>(a + o_ga) : nullptr;
  float* const bsum = sums ? reinterpret_cast<float*>(a + o_s) : nullptr;
  int32_t* const lsum = lanes ? reinterpret_cast<int32_t*>(a + o_s) : nullptr;
  int32_t* const zb = vnni256 ? reinterpret_cast<int32_t*>(a + o_zb) : nullptr;
  const uint8_t flip = isa != Isa::kScalar ? 0x80 : 0;
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    if (ga) {  // each token's groups as rows of g: symmetric, so every group's zero point is 0 (zp128 = 128)
      thread_local std::vector<int32_t> gzp;  // quantize_rows' zero-point output, unused: kept across calls
      if ((int64_t)gzp.size() < G) gzp.resize(G);
      for (int64_t m = m0; m < m1; ++m) {
        quantize_rows(isa, x2.data_ptr<float>() + m * K, g, g, true, a + m * lda, g, a_gscale + m * G, gzp.data(), 0, G,
                      bits);
        a_scale[m] = 1.f;
        zp[m] = 128;
      }
    } else {
      quantize_rows(isa, x2.data_ptr<float>(), K, K, act_symmetric, a, lda, a_scale, zp, m0, m1, bits);
    }
    for (int64_t m = m0; m < m1; ++m) {
      const uint8_t* ar = a + m * lda;
      uint8_t* pr = ap + m * lda;
      if (panel || panel256) {  // block-major [k / kb][m][k % kb]: a block's codes of all tokens contiguous
        const uint8_t f = panel ? 0 : flip;
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
          uint8_t* dst = ap + (k0 / kb * M + m) * kb;
          const int64_t n = std::min(kb, K - k0);
          for (int64_t i = 0; i < n; ++i) dst[i] = ar[k0 + i] ^ f;
          std::memset(dst + n, 0, kb - n);
          if (zb) {  // the block's sum of a - zp128 (dst holds a - 128 as int8) and -zpa, as int16 pairs
            int32_t t = 0;
            for (int64_t i = 0; i < n; ++i) t += (int8_t)dst[i];
            const int32_t zpa = zp[m] - 128, bs = t - zpa * (int32_t)n;
            zb[k0 / kb * M + m] = (int32_t)((uint32_t)(uint16_t)(-zpa) | ((uint32_t)(uint16_t)(-bs) << 16));
          }
        }
        if (regs && !sums) continue;
      } else {  // each 128-k block as [even k | odd k]
        for (int64_t b = 0; b < lda; b += 128) {
          for (int64_t i = 0; i < 64; ++i) {
            const int64_t k = b + 2 * i;
            pr[b + i] = k < K ? (uint8_t)(ar[k] ^ flip) : 0;
            pr[b + 64 + i] = k + 1 < K ? (uint8_t)(ar[k + 1] ^ flip) : 0;
          }
        }
      }
      const int32_t z = zp[m];
      if (lanes) {
        int32_t* ls = lsum + m * (lda / 8);
        for (int64_t j = 0; j < lda / 8; ++j) {
          int32_t t = 0;
          for (int64_t k = 8 * j; k < std::min(8 * j + 8, K); ++k) t += ar[k] - z;
          ls[j] = 8 * t;
        }
        continue;
      }
      for (int64_t gi = 0; gi < G; ++gi) {
        int32_t t = 0;
        for (int64_t k = gi * g; k < (gi + 1) * g; ++k) t += ar[k];
        bsum[m * G + gi] = (float)(t - z * (int32_t)g);
      }
    }
  });
  const DaInt4Args p{ap, M, K, lda, a_scale, a_gscale, zp, bsum, lsum, zb, qdata.data_ptr<uint8_t>(), N, qdata.stride(0),
                     s.data_ptr(), sz_type(s.scalar_type(), op), zw.defined() ? zw.data_ptr<int8_t>() : nullptr,
                     zf_after || !zf.defined() ? nullptr : zf.data_ptr(), G, g,
                     b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
  const bool vex = isa == Isa::kAvxVnni && avx_vnni_vex_selected();  // the AVX-VNNI build, asked at that level only
  if (panel || panel256) {
    if (panel) {
      at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t j0, int64_t j1) {
        avx512::da_int4_prefill(p, j0, j1, amx);
      });
    } else {
      at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t j0, int64_t j1) {
        if (isa == Isa::kAvx2) return avx2::da_int4_prefill(p, j0, j1);
        return vex ? avx_vnni::da_int4_prefill(p, j0, j1) : avx_vnni_evex::da_int4_prefill(p, j0, j1);
      });
    }
    if (zf_after) {  // out += (activation scale x group sums) (M, G) @ z^T (G, N)
      const at::Tensor asum = at::from_blob(bsum, {M, G}, x2.options()) *
                              (ga ? at::from_blob(a_gscale, {M, G}, x2.options())
                                  : at::from_blob(a_scale, {M, 1}, x2.options()));
      out.addmm_(asum, zf.to(at::kFloat).t());
    }
    return out.to(dt).reshape(shape);
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    switch (isa) {
      case Isa::kAvx512Vnni: return avx512::da_int4(p, n0, n1);
      case Isa::kAvxVnni: return vex ? avx_vnni::da_int4(p, n0, n1) : avx_vnni_evex::da_int4(p, n0, n1);
      case Isa::kAvx2: return avx2::da_int4(p, n0, n1);
      default: return scalar::da_int4(p, n0, n1);
    }
  });
  return out.to(dt).reshape(shape);
}

// What kernels.status() says serves the op at each level (Note [Kernel descriptions] in kernel_descriptions.cpp; the
// kernels' lanes: Note [int8 x int4 decode] in int4_packed_dot.inc).
const DescribeOp kDescribed(
    OpDescription("torchqkit::linear_int8da_int4_packed")
        .at("amx",
            "amx: M >= 16 with k blocks of whole 64-k steps (groups of 64 or more, or per channel) the expanded int8 "
            "panels multiply on AMX-INT8 tiles (tdpbusd, exact int32 sums, the same epilogue: Note [int8 panels on "
            "AMX]); groups of 32 and M < 16: the avx512_vnni kernels")
        .at("avx512_vnni",
            "M < 12: vpdpbusd on low / high nibbles (128 k per zmm, exact int32 per lane, per-lane group scales) "
            "against the per-call quantized, permuted activation, 4 tokens per pass; M >= 12: nibbles expanded to int8 "
            "panels + 6x32 vpdpbusd tiles over panels of 4096 k, each block's int32 sums folded into fp32 accumulators "
            "in registers")
        .at("avx_vnni",
            "M < 16: the 256-bit decode kernel with vpdpbusd (VEX; EVEX on ymm where only AVX-512 VNNI exists), 2 "
            "tokens per pass; M >= 16: 16-row nibble panels x 6-token tiles (vpdpbusd) over panels of 4096 k, each "
            "block's int32 sums in registers, folded into fp32 once per block")
        .at("avx2",
            "M < 16: vpmaddubsw + vpmaddwd, unsigned nibbles x signed activation codes (64 k per ymm, exact int32 per "
            "lane) against the permuted activation, 2 tokens per pass; M >= 16: 16-row nibble panels x 4-token tiles "
            "(vpmaddubsw int16 windows of 32 k, then vpmaddwd)")
        .at("scalar", "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it"));

// A stack of experts (E, N, K / 2) of these codes, scale (E, N, ...), zero_point likewise or none: rows
// [offs[g - 1], offs[g]) of x through expert g (Note [Grouped linear in C++], grouped_rows.h).
at::Tensor grouped_linear_int8da_int4_packed(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                             const at::Tensor& scale, const std::optional<at::Tensor>& zero_point,
                                             bool act_symmetric, int64_t act_group_size, int64_t act_bits) {
  constexpr const char* op = "torchqkit::grouped_linear_int8da_int4_packed";
  TORCH_CHECK(qdata.dim() == 3 && scale.dim() >= 2 && qdata.size(0) == scale.size(0), op,
              ": qdata (E, N, K / 2) and scale (E, N, ...) of the same E experts, got ", qdata.sizes(), " and ",
              scale.sizes());
  return grouped_rows(op, x, offs, qdata.size(0), qdata.size(1), [&](const at::Tensor& rows, int64_t g) {
    const std::optional<at::Tensor> zp =
        zero_point.has_value() ? std::optional<at::Tensor>(zero_point->select(0, g)) : std::nullopt;
    return linear_int8da_int4_packed(rows, qdata.select(0, g), scale.select(0, g), zp, {}, act_symmetric,
                                     act_group_size, act_bits);
  });
}

const DescribeOp kGroupedInt8DynamicInt4Described(
    grouped_description("torchqkit::grouped_linear_int8da_int4_packed", "torchqkit::linear_int8da_int4_packed"));

}  // namespace
}  // namespace torchqkit_cpu

TORCH_LIBRARY_IMPL(torchqkit, CPU, m) {
  m.impl("linear_int8da_int4_packed", &torchqkit_cpu::linear_int8da_int4_packed);
  m.impl("grouped_linear_int8da_int4_packed", &torchqkit_cpu::grouped_linear_int8da_int4_packed);
}
