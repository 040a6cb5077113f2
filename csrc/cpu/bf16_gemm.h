// AVX512-BF16 GEMM pieces for the weight-only kernels: a k-pair bf16 panel and its register-blocked vdpbf16ps
// micro-kernel with per-segment weight scales, shared by every op family that decodes weights to exact bf16
// values (low-bit levels, int8 / int4 codes, float8 values) and multiplies them by bf16 activations.
//
// Note [bf16 panels]: vdpbf16ps multiplies two bf16 pairs per 32-bit lane and adds both products to the lane's
// fp32 accumulator. A panel holds 32 weight rows for kc consecutive k (kc even) as [kc / 2][32] 32-bit words,
// word (kp, j) = (w[j][2 kp], w[j][2 kp + 1]) (low half first); an activation row is read as the same pairs,
// one 32-bit broadcast per k pair. The panel holds unscaled values (codes or levels, exact in bf16); a scale
// per row and per *segment* of k (a quantization group, or any whole part of one) multiplies the segment's
// fp32 partial sums once: acc += seg_acc * scale. So the products are exact, the accumulation fp32, and the
// only rounding beyond the fp32 path's is the activations' own bf16.
//
// Every function carries its own target attribute (no `#pragma GCC target` region needed); call them only
// when the CPU runs Isa::kAvx512Bf16 (isa_supported).
#pragma once
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "aligned_vector.h"
#include "amx_bf16_gemm.h"

namespace torchqkit_cpu {
bool amx_selected();  // the selected level is `amx` (registration.cpp): panels go to AMX tiles

namespace bf16_gemm {

#define TQK_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
#define TQK_BF16_INLINE TQK_BF16 __attribute__((always_inline)) static inline

constexpr int kPanelCols = 32;  // weight rows per panel (two zmm of 16 fp32 lanes)
constexpr int kMaxRows = 6;     // activation rows per micro-kernel call: 6 x 2 accumulators + 6 x 2 segment sums
constexpr int64_t kPanelK = 256;  // k per panel block: 128 pairs x 32 rows x 4 bytes = 16 KiB, in L1

// The scale's span along k inside a panel block (Note [bf16 panels]) for G groups of g k: the group, or the
// largest multiple of 32 dividing it that fits a block; one scale per row (G == 1) is one segment per block.
// Groups must be whole 32-k steps (g % 32 == 0) unless G == 1.
inline int64_t segment_k(int64_t G, int64_t g) {
  if (G == 1) return kPanelK;
  for (int64_t s = std::min(g, kPanelK); s > 32; s -= 32)
    if (g % s == 0) return s;
  return 32;
}
// k per panel block for segments of seg k: whole segments, about kPanelK.
inline int64_t panel_block_k(int64_t seg) { return seg * std::max<int64_t>(1, kPanelK / seg); }

// 32 fp32 values -> 32 bf16 (round to nearest even), v0 in the low 16 lanes: the k order of a decode step.
TQK_BF16_INLINE __m512i to_bf16(__m512 v0, __m512 v1) { return (__m512i)_mm512_cvtne2ps_pbh(v1, v0); }

// 16 x 16 32-bit words in registers transposed: r[i] word j -> r[j] word i. Panels are filled 16 rows x 16 k
// pairs at a time: each row's decode step is a zmm of 16 pairs, the panel wants 16 rows per pair.
TQK_BF16_INLINE void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (r_i[0] r_i+1[0] r_i[1] r_i+1[1]), (.. [2] .. [3])
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int a = 0; a < 16; a += 4) {  // u[a + b], 128-bit lane L: rows a..a+3 of column 4 L + b
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {  // column 4 L + b gathers lane L of u[b], u[4 + b], u[8 + b], u[12 + b]
    const __m512i x0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x44), x1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xEE);
    r[b] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + b] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + b] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + b] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// 16 rows' next 16 k pairs (r[i]: row j0 + i, k pairs kp0..kp0+15, each a zmm of k-ordered bf16) -> panel.
TQK_BF16_INLINE void store_pairs16(__m512i (&r)[16], uint32_t* panel, int64_t kp0, int j0) {
  transpose16x16(r);
#pragma GCC unroll 16
  for (int q = 0; q < 16; ++q) _mm512_storeu_si512(panel + (kp0 + q) * kPanelCols + j0, r[q]);
}

// The 32-bit word (a[2 kp], a[2 kp + 1]) of a bf16 activation row, in every lane.
TQK_BF16_INLINE __m512bh pair_of(const uint16_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// One segment's k pairs into the R x 2 segment sums (a function taking the arrays by reference, not a lambda:
// Note [accumulators in registers] in kernels.h).
template <int R>
TQK_BF16_INLINE void segment(__m512 (&s)[R][2], const uint16_t* a, int64_t lda, const uint32_t* panel, int64_t kp0,
                             int64_t kp1) {
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + kp * kPanelCols);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + kp * kPanelCols + 16);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      const __m512bh av = pair_of(a + m * lda + 2 * kp);
      s[m][0] = _mm512_dpbf16_ps(s[m][0], av, b0);
      s[m][1] = _mm512_dpbf16_ps(s[m][1], av, b1);
    }
  }
}

// C[0:R, 0:ncols] (+)= sum over segments s of (A[0:R, seg s] @ panel[seg s]) * seg_scale[s][0:32]
// A: bf16 activations (row stride lda elements), k [0, kc); panel: [kc / 2][32] (Note [bf16 panels]); segments of
// `seg` k (even; the last may be shorter); seg_scale: [ceil(kc / seg)][32] fp32; first: C = result, else C += result.
template <int R>
TQK_BF16 void gemm_rx32(const uint16_t* a, int64_t lda, const uint32_t* panel, int64_t kc, int64_t seg,
                        const float* seg_scale, float* c, int64_t ldc, int ncols, bool first) {
  __m512 acc[R][2];
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0, si = 0; k0 < kc; k0 += seg, ++si) {
    __m512 s[R][2];
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) s[m][0] = s[m][1] = _mm512_setzero_ps();
    segment<R>(s, a, lda, panel, k0 / 2, (k0 + seg < kc ? k0 + seg : kc) / 2);
    const __m512 sc0 = _mm512_loadu_ps(seg_scale + si * kPanelCols), sc1 = _mm512_loadu_ps(seg_scale + si * kPanelCols + 16);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      acc[m][0] = _mm512_fmadd_ps(s[m][0], sc0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(s[m][1], sc1, acc[m][1]);
    }
  }
  const __mmask16 m0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? (__mmask16)0xFFFF : ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) {
    float* cr = c + m * ldc;
    if (!first) {
      acc[m][0] = _mm512_add_ps(acc[m][0], _mm512_maskz_loadu_ps(m0, cr));
      acc[m][1] = _mm512_add_ps(acc[m][1], _mm512_maskz_loadu_ps(m1, cr + 16));
    }
    _mm512_mask_storeu_ps(cr, m0, acc[m][0]);
    _mm512_mask_storeu_ps(cr + 16, m1, acc[m][1]);
  }
}

// gemm_rx32 for R = rows (1..kMaxRows) known at run time.
TQK_BF16 inline void gemm(int rows, const uint16_t* a, int64_t lda, const uint32_t* panel, int64_t kc, int64_t seg,
                          const float* seg_scale, float* c, int64_t ldc, int ncols, bool first) {
  switch (rows) {
    case 6: return gemm_rx32<6>(a, lda, panel, kc, seg, seg_scale, c, ldc, ncols, first);
    case 5: return gemm_rx32<5>(a, lda, panel, kc, seg, seg_scale, c, ldc, ncols, first);
    case 4: return gemm_rx32<4>(a, lda, panel, kc, seg, seg_scale, c, ldc, ncols, first);
    case 3: return gemm_rx32<3>(a, lda, panel, kc, seg, seg_scale, c, ldc, ncols, first);
    case 2: return gemm_rx32<2>(a, lda, panel, kc, seg, seg_scale, c, ldc, ncols, first);
    default: return gemm_rx32<1>(a, lda, panel, kc, seg, seg_scale, c, ldc, ncols, first);
  }
}

// C[0:M, 0:ncols] += xsum[0:M, 0:G] @ zp[0:G][32] in fp32 FMAs: the term sum_g (sum_k x[m, k]) z[n, g] of a
// format with a float offset per (row, group) (int4 float zero points, intx zero points). Not a torch matmul:
// under torch.set_float32_matmul_precision("medium") that would itself round its operands to bf16.
TQK_BF16 inline void add_group_terms(int64_t M, const float* xsum, int64_t G, const float* zp, float* c, int64_t ldc,
                                     int ncols) {
  const __mmask16 m0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? (__mmask16)0xFFFF : ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
  for (int64_t m = 0; m < M; ++m) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    const float* xs = xsum + m * G;
    for (int64_t gi = 0; gi < G; ++gi) {
      const __m512 x = _mm512_set1_ps(xs[gi]);
      a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(zp + gi * kPanelCols), a0);
      a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(zp + gi * kPanelCols + 16), a1);
    }
    float* cr = c + m * ldc;
    _mm512_mask_storeu_ps(cr, m0, _mm512_add_ps(a0, _mm512_maskz_loadu_ps(m0, cr)));
    _mm512_mask_storeu_ps(cr + 16, m1, _mm512_add_ps(a1, _mm512_maskz_loadu_ps(m1, cr + 16)));
  }
}

#undef TQK_BF16_INLINE
#undef TQK_BF16

// ================================================================ the panel loop every format shares
// Note [bf16 panel loop]: for each 32-row panel of the caller's rows, k blocks of at most kc_max (a multiple of
// seg, and of the 32-k decode step every format fills with): the format's fill decodes the panel and its segment
// scales, then every 6-row tile of activations runs over it (gemm). The panel (kc_max / 2 x 32 words: 16 KiB at
// 256 k) stays in L1; a 32-column slice of C (M x 128 bytes) in L2. A format knows only how to fill a panel. The
// `amx` level loops differently (panel_gemm_amx, Note [AMX panel blocking]) over the same fills.
struct PanelProblem {
  const uint16_t* xb;  // (M, ldx) bf16 activations, zero columns from K up to k_extent (amx: packed, see planes)
  int64_t M, ldx;
  int64_t k_extent;    // k covered by the panels: K rounded up to the format's 32-k steps (<= ldx)
  int64_t kc_max, seg; // k per panel block (a multiple of seg), k per scale segment (even)
  float* out;          // (M, ldo) fp32, written (not accumulated)
  int64_t ldo;
  const float* bias;   // (N) or nullptr
  const float* xsum;   // (M, G) per-group sums of x for the offsets' term, or nullptr (no offsets)
  int64_t G;
  // At the amx level xb is packed for the tiles (Note [activations packed for AMX]), as `planes` planes that sum
  // to the activations: 3 for float32 ones (Note [fp32 activations on AMX]), else 1.
  int planes = 1;
};

// The zero-point term and bias of rows [c0, c0 + nc) (one panel's), after its k blocks.
template <class Offsets>
void panel_epilogue(const PanelProblem& pb, int64_t c0, int nc, Offsets& offsets, float* zp) {
  if (pb.xsum) {
    offsets(c0, nc, zp);
    add_group_terms(pb.M, pb.xsum, pb.G, zp, pb.out + c0, pb.ldo, nc);
  }
  if (pb.bias)
    for (int64_t m = 0; m < pb.M; ++m)
      for (int j = 0; j < nc; ++j) pb.out[m * pb.ldo + c0 + j] += pb.bias[c0 + j];
}

// Note [AMX panel blocking]: the vdpbf16ps loop fills one panel and runs every token over it, so the activations
// stream from memory once per panel; for AMX, whose tiles outrun that stream, that order made a float32 call with
// M = 1000, K = 1536, N = 384 (MiniLM's down projection) 2.6x slower than fp32 F.linear: its three planes (9 MB)
// came from L3 for every pair of panels. So the amx loop fills up to kAmxPanels panels of one k block (128 KiB at
// 256 k, in L2) and runs each 32-token block of activations (48 KiB with three planes) over all of them before the
// next: the activations are read once per k block and panel group, from L2 / L1 in between (9.1 -> 5.8 ms there;
// the one-pass split of pack_fp32_planes then 3.5 ms, 1.03x fp32; bf16 x 4096^2 at M = 256 unchanged).
constexpr int kAmxPanels = 8;

template <class Fill, class Offsets>
void panel_gemm_amx(const PanelProblem& pb, int64_t n0, int64_t n1, Fill& fill, Offsets& offsets) {
  const int64_t panel_words = pb.kc_max / 2 * kPanelCols, panel_scales = (pb.kc_max / pb.seg + 1) * kPanelCols;
  AlignedVector<uint32_t> panels(kAmxPanels * panel_words);
  AlignedVector<float> scales(kAmxPanels * panel_scales);
  std::vector<float> zp(pb.xsum ? pb.G * kPanelCols : 0);
  const int step = pb.planes > 1 ? 2 : 1;  // panels per call: pairs with planes (Note [two panels per A tile])
  const int64_t R = amx::kBlockRows, block_elems = pb.ldx / 32 * pb.planes * (R * 32);
  bool configured = false;
  for (int64_t g0 = n0; g0 < n1; g0 += kAmxPanels * kPanelCols) {
    const int64_t group_cols = std::min<int64_t>(kAmxPanels * kPanelCols, n1 - g0);
    const int np = static_cast<int>((group_cols + kPanelCols - 1) / kPanelCols);
    const auto cols = [&](int p) { return static_cast<int>(std::clamp<int64_t>(n1 - g0 - p * kPanelCols, 0, kPanelCols)); };
    for (int64_t k0 = 0; k0 < pb.k_extent; k0 += pb.kc_max) {
      const int64_t kc = std::min(pb.kc_max, pb.k_extent - k0);
      for (int p = 0; p < np; ++p)
        fill(g0 + p * kPanelCols, cols(p), k0, kc, panels.data() + p * panel_words, scales.data() + p * panel_scales);
      for (int64_t m = 0; m < pb.M; m += R) {
        for (int p = 0; p < np; p += step) {
          const bool two = step == 2 && p + 1 < np;
          const uint32_t* const pp[2] = {panels.data() + p * panel_words,
                                         two ? panels.data() + (p + 1) * panel_words : nullptr};
          const float* const ss[2] = {scales.data() + p * panel_scales, scales.data() + (two ? p + 1 : p) * panel_scales};
          const int nc[2] = {cols(p), two ? cols(p + 1) : 0};
          amx_bf16::gemm(std::min<int64_t>(R, pb.M - m), pb.xb + m / R * block_elems, pb.ldx, pb.planes, k0, pp, kc,
                         pb.seg, ss, pb.out + m * pb.ldo + g0 + p * kPanelCols, pb.ldo, nc, k0 == 0, configured);
        }
      }
    }
    for (int p = 0; p < np; ++p) panel_epilogue(pb, g0 + p * kPanelCols, cols(p), offsets, zp.data());
  }
  if (configured) amx::release();
}

// Rows [n0, n1) of out. fill(b0, nb, k0, kc, panel, sc): rows [b0, b0 + nb) x k [k0, k0 + kc) into panel and
// sc[s][32] (rows past nb zero); offsets(b0, nb, zp): zp[g][32] the offsets of those rows (only with xsum).
// Call only when the CPU runs Isa::kAvx512Bf16.
template <class Fill, class Offsets>
void panel_gemm(const PanelProblem& pb, int64_t n0, int64_t n1, Fill&& fill, Offsets&& offsets) {
  if (amx_selected()) return panel_gemm_amx(pb, n0, n1, fill, offsets);
  TORCH_CHECK(pb.planes == 1, "bf16 panels: ", pb.planes, " activation planes need the amx level");
  AlignedVector<uint32_t> panel(pb.kc_max / 2 * kPanelCols);
  AlignedVector<float> sc((pb.kc_max / pb.seg + 1) * kPanelCols);
  std::vector<float> zp(pb.xsum ? pb.G * kPanelCols : 0);
  for (int64_t b0 = n0; b0 < n1; b0 += kPanelCols) {
    const int nb = static_cast<int>(std::min<int64_t>(kPanelCols, n1 - b0));
    for (int64_t k0 = 0; k0 < pb.k_extent; k0 += pb.kc_max) {
      const int64_t kc = std::min(pb.kc_max, pb.k_extent - k0);
      fill(b0, nb, k0, kc, panel.data(), sc.data());
      for (int64_t m = 0; m < pb.M; m += kMaxRows)
        gemm(static_cast<int>(std::min<int64_t>(kMaxRows, pb.M - m)), pb.xb + m * pb.ldx + k0, pb.ldx, panel.data(),
             kc, pb.seg, sc.data(), pb.out + m * pb.ldo + b0, pb.ldo, nb, k0 == 0);
    }
    panel_epilogue(pb, b0, nb, offsets, zp.data());
  }
}

}  // namespace bf16_gemm
}  // namespace torchqkit_cpu
