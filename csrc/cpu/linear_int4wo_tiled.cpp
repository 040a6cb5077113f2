// CPU backend of torchqkit::linear_int4wo_tiled: int4 group-wise weight-only linear reading the
// TensorCoreTiledLayout bytes as stored (no repacking per ISA), x float32 / bfloat16 / float16, fp32 math.
//
// See Note [Tensor-core tiled int4] in torchqkit/layouts/tensor_core_tiled.py for the bit layout. What a
// CPU kernel uses from it: an n-tile's chunk j is one block of 16 T int32 words (8 rows x 2 T words, T =
// inner_k_tiles); block word b belongs to row r = b / (2 T) and, with c = (b % 2T) / (T/2), w = b % (T/2),
// its nibble p = 4 e + 2 u + h holds k = 16 T j + 16 (2 w + u) + 8 h + 2 c + e. The pattern repeats every
// 2 T words, so every 16-word vector of a block sees the same k per (lane, nibble): the activation is
// permuted once per call into xp[m][j][p][16] and the weights stream linearly. A word lies in one group
// of 32 k (g >= 32), so per-lane group scales apply after the 8 nibbles of a word.
//
// Note [int4 tiled math]: with codes u (0..15), group scale s and float zero z, w = (u - 8) s + z, so
//   y[m, n] = sum_groups s * (sum_k x u) + (z - 8 s) * (sum_k x)  + bias[n]
// The inner loop only converts nibbles to floats and multiplies by x (one vpermps table lookup per 16
// nibbles on AVX-512); the second term uses per-group sums of x computed once per call.
//
// Paths: decode ("dot") kernels stream each weight byte once per block of up to 4 tokens (scalar, AVX2,
// AVX-512). Prefill (AVX-512, M >= kPrefillMinM): blocks of 192 rows are dequantized to fp32 in a permuted
// k order and run through the fp32 panel micro-kernel of linear_int8.cpp against the equally permuted
// activation, see Note [int4 prefill].
#include <ATen/ATen.h>
#include "parallel.h"
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "aligned_vector.h"
#include "avx2_reduce.h"
#include "panel_activations.h"
#include "bf16_gemm.h"
#include "fp32_matmul_precision.h"
#include "grouped_rows.h"
#include "kernel_descriptions.h"
#include "kernels.h"
#include "route_choice.h"
#include "sgemm_prefill.h"
#include "scale_dtype.h"
#include "simd.h"

namespace torchqkit_cpu {
namespace {

struct Int4Args {
  const int32_t* q;  // [NT][NC][16 T] words; n-tile stride ldq words, chunk blocks contiguous
  int64_t NT, NC, T, ldq;
  const void* sz;    // [G][N8][2] (scale, zero) of type szt, group stride lds elements
  SzType szt;
  int64_t lds, g, G;
  int64_t K, N;      // in_features (<= Kt = NC * 16 T), out_features (<= 8 NT)
  const float* xp;   // (M, NC, 8, 16) permuted activation, see Note above; zero where k >= K
  const float* sx;   // (M, G) per-group sums of x
  int64_t M;
  const float* bias;  // (N) or nullptr
  float* out;        // (M, N), row stride ldo
  int64_t ldo;
  const uint32_t* xb;  // (M, NC, 4, 16) bf16 activation pairs of the AVX512-BF16 decode (Note [int4 bf16 decode])
  // Note [scales staged per block]: n-tile i reads its scales at sz + (g lds + 16 (i - sz_i0)) elements: the stored
  // ones (sz_i0 = 0) or a block's copy. The decode kernels run n-tiles [blk0, nxt0) and prefetch the scales of
  // [nxt0, nxt1), the next block, from where they are stored (src, lds_src); src == nullptr: no blocks.
  int64_t sz_i0, blk0, nxt0, nxt1;
  const void* src;
  int64_t lds_src;
};

// Element e (0 = scale, 1 = zero) of row n, group gi, as float.
inline float sz_at(const Int4Args& p, int64_t gi, int64_t n, int e) {
  return load_float(p.sz, p.szt, gi * p.lds + 2 * (n - 8 * p.sz_i0) + e);
}

// k of (block word lane l % 2T, nibble p) within chunk j, Note [Tensor-core tiled int4].
inline int64_t k_of(int64_t T, int64_t j, int64_t l, int p) {
  const int64_t l2 = l % (2 * T), c = l2 / (T / 2), w = l2 % (T / 2);
  const int e = p >> 2, u = (p >> 1) & 1, h = p & 1;
  return 16 * T * j + 16 * (2 * w + u) + 8 * h + 2 * c + e;
}

// Epilogue shared by every ISA: rows' sums of s * (x . u) in dot[m][r], plus the zero term
// zt[m][r] = sum_groups (z - 8 s) * sum_k x (computed here when zt is nullptr), plus bias.
void finish_tile(const Int4Args& p, int64_t i, int64_t m0, int mb, const float (*dot)[8], const float (*zt)[8]) {
  for (int r = 0; r < 8; ++r) {
    const int64_t n = 8 * i + r;
    if (n >= p.N) break;
    for (int m = 0; m < mb; ++m) {
      float z = 0.f;
      if (zt) {
        z = zt[m][r];
      } else {
        const float* sx = p.sx + (m0 + m) * p.G;
        for (int64_t gi = 0; gi < p.G; ++gi) z += (sz_at(p, gi, n, 1) - 8.f * sz_at(p, gi, n, 0)) * sx[gi];
      }
      p.out[(m0 + m) * p.ldo + n] = dot[m][r] + z + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

constexpr int64_t kPfChunks = 12;  // Note [decode prefetch] (int4_tiled_dot.inc): 6 KiB ahead at T = 8 (swept 4..64)
constexpr int64_t kPfSzChunks = 8;  // the scales' distance, in chunks (Note [decode prefetch])

// Note [scales staged per block]: the (scale, zero) pairs are stored [G][N8][2], so an n-tile reads a 32- or 64-byte
// piece of each of G rows lds elements apart. At K = 576 (G = 18 at g = 32) that is cheap, but at K = 4096 and g = 32
// the 128 rows are 16 KiB apart when N = 4096: every piece of a tile falls in the same few L1 / L2 sets (a power-of-
// two stride), and each scale line was a DRAM access of its own. A 4096 x 4096 M = 1 call took 1.24 ms against
// 0.52 ms at g = 128 and 0.68 ms at N = 4104, whose stride is not a power of two (bench_linear.py --formats int4
// --int4-group 32; Intel Xeon, 2 threads, weights from DRAM). So from kSzBlockMinGroups groups on, each thread takes
// its n-tiles in blocks of B (scales of about kSzBlockBytes, scale_block_tiles). While a block runs, each chunk
// prefetches its share of the next block's pieces into L2 group by group (each group's piece is a contiguous run of
// B 32 or 64 bytes); before the next block runs, its pieces are copied into a per-thread buffer whose group rows are
// an odd number of cache lines apart (no set conflicts), where the kernel reads them. A thread's first block reads
// the stored scales: copying them first would wait for DRAM before any work (SmolLM2's 576 x 1536, one block a
// thread, was 13% slower that way).
// The threshold was 48 until the 2-vCPU Zen 5 ran M = 1 calls with 8..32 groups 1.1-1.3x faster staged (weights from
// memory, both thresholds alternating in one process): 4096^2 g128 (G = 32) 336 -> 278 us, SmolLM2's lm_head 49152 x
// 576 g32 (G = 18) 760 -> 565 us, 1536 x 11008 g128 (G = 12) 278 -> 235 us: a tile's G short pieces far apart
// are G streams for the hardware prefetcher to follow, and with N a multiple of 1024 they share one L1 set. Small
// layers (576 x 1536 g32, 1536 x 576 g128) and the AVX2 level (bound by its instructions) were unchanged, and a
// threshold of 4 was no faster than 8.
constexpr int64_t kSzBlockMinGroups = 8;
constexpr int64_t kSzBlockBytes = 64 * 1024;

inline int64_t sz_bytes(const Int4Args& p) { return p.szt == SzType::kF32 ? 4 : 2; }

int64_t scale_block_tiles(int64_t G, SzType szt) {
  if (G < kSzBlockMinGroups) return 0;
  const int64_t tile_bytes = G * 16 * (szt == SzType::kF32 ? 4 : 2);
  return std::max<int64_t>(2, std::min<int64_t>(64, kSzBlockBytes / tile_bytes));
}

// Elements between two group rows of the staging buffer for blocks of B n-tiles: rounded up to an odd number of lines.
inline int64_t staged_lds(const Int4Args& p, int64_t B) {
  int64_t lines = (B * 16 * sz_bytes(p) + 63) / 64;
  if (lines % 2 == 0) ++lines;
  return lines * 64 / sz_bytes(p);
}

// p reading the scales of n-tiles [b0, b1) from buf (staged_lds(p, B) * G elements), copied there now.
Int4Args stage_scales(const Int4Args& p, int64_t b0, int64_t b1, int64_t B, char* buf) {
  Int4Args a = p;
  const int64_t esz = sz_bytes(p), lds = staged_lds(p, B), bytes = (b1 - b0) * 16 * esz;
  const char* src = static_cast<const char*>(p.sz) + 16 * b0 * esz;
  for (int64_t g = 0; g < p.G; ++g) std::memcpy(buf + g * lds * esz, src + g * p.lds * esz, bytes);
  a.sz = buf;
  a.lds = lds;
  a.sz_i0 = b0;
  return a;
}

// Per chunk (i, j). In blocks: this chunk's share of the next block's pieces, group by group, into L2 (Note [scales
// staged per block]). Else, reading the stored scales, into L1 the scale and zero lines of the `groups` groups of chunk
// (i, j) + kPfSzChunks, counting chunks in tile order (i, then j); nothing past the last tile.
inline void prefetch_scales(const Int4Args& p, int groups, int64_t i, int64_t j) {
  const int64_t esz = sz_bytes(p);
  if (p.nxt1 > p.nxt0) {
    const int64_t lines = ((p.nxt1 - p.nxt0) * 16 * esz + 63) / 64 + 1;  // + 1: a piece need not start a line
    const int64_t chunks = (p.nxt0 - p.blk0) * p.NC, total = p.G * lines, per = (total + chunks - 1) / chunks;
    const int64_t t0 = ((i - p.blk0) * p.NC + j) * per, t1 = std::min(total, t0 + per);
    const char* base = static_cast<const char*>(p.src) + 16 * p.nxt0 * esz;
    int64_t g = t0 / lines, l = t0 - g * lines;  // line l of group g's piece; one division per chunk
    for (int64_t t = t0; t < t1; ++t) {
      _mm_prefetch(base + g * p.lds_src * esz + 64 * l, _MM_HINT_T1);
      if (++l == lines) l = 0, ++g;
    }
    return;
  }
  if (p.src != nullptr && p.sz != p.src) return;  // a staged last block: its scales are in the buffer
  const int64_t f = j + kPfSzChunks, ii = i + f / p.NC, jj = f % p.NC;
  if (ii >= p.NT) return;
  const int64_t g0 = 16 * p.T * jj / p.g;
  const char* base = static_cast<const char*>(p.sz) + (g0 * p.lds + 16 * ii) * esz;
  for (int q = 0; q < groups; ++q) _mm_prefetch(base + q * p.lds * esz, _MM_HINT_T0);
}

// ================================================================================================
// Scalar: any x86-64 CPU.
// ================================================================================================
namespace scalar {

void dot_tiles(const Int4Args& p, int64_t i0, int64_t i1) {
  const int64_t T = p.T, bw = 16 * T;
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t m0 = 0; m0 < p.M; m0 += 4) {
      const int mb = (int)std::min<int64_t>(4, p.M - m0);
      float dot[4][8] = {};
      for (int64_t j = 0; j < p.NC; ++j) {
        const int32_t* blk = p.q + i * p.ldq + j * bw;
        for (int64_t b = 0; b < bw; ++b) {
          const int64_t r = b / (2 * T), w = b % (T / 2);
          const float s = sz_at(p, (16 * T * j + 32 * w) / p.g, 8 * i + r, 0);
          const uint32_t word = (uint32_t)blk[b];
          for (int m = 0; m < mb; ++m) {
            const float* xp = p.xp + ((m0 + m) * p.NC + j) * 128 + b % 16;
            float d = 0.f;
            for (int q = 0; q < 8; ++q) d += xp[16 * q] * (float)((word >> (4 * q)) & 0xF);
            dot[m][r] += s * d;
          }
        }
      }
      finish_tile(p, i, m0, mb, dot, nullptr);
    }
  }
}

}  // namespace scalar

// ================================================================================================
// AVX2 + FMA: 8 words (64 nibbles) per ymm; nibble q -> float by a mask and a conversion (no shift: the
// activation is pre-divided by 2^(4q), see permute_activation).
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// 16 floats (s0, z0, ..., s7, z7) of n-tile i in group gi, as two vectors (rows 0-3, rows 4-7).
inline void load_sz(const Int4Args& p, int64_t gi, int64_t i, __m256 out[2]) {
  const int64_t off = gi * p.lds + 16 * (i - p.sz_i0);
  for (int h = 0; h < 2; ++h) {
    switch (p.szt) {
      case SzType::kF32: out[h] = _mm256_loadu_ps(static_cast<const float*>(p.sz) + off + 8 * h); break;
      case SzType::kBF16: {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p.sz) + off + 8 * h));
        out[h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
        break;
      }
      default:
        out[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p.sz) + off + 8 * h)));
    }
  }
}

// Lane scales of the 2 T vectors of a chunk: vector v (words 8 v .. 8 v + 7) lies in one row half (its rows
// r = b / 2T are 2 v, 2 v + 1 for T = 2, v / (T / 4) otherwise); lane l takes s[r] of its group q = 32 w / g,
// w = b % (T / 2): one permute per group and a blend per extra group.
struct LaneMap {
  __m256i idx[16];    // r: the lane's row, an index into a group's row scales (Vec::Scales::s)
  __m256 sel[16][4];  // all-ones lanes of group q
  int groups;         // groups per chunk: 1, 2 or 4
};

LaneMap lane_map(int64_t T, int64_t g) {
  LaneMap lm;
  lm.groups = (int)std::max<int64_t>(1, 16 * T / g);
  for (int v = 0; v < 2 * T; ++v) {
    alignas(32) int32_t idx[8];
    alignas(32) int32_t sel[4][8];
    for (int l = 0; l < 8; ++l) {
      const int64_t b = 8 * v + l, r = b / (2 * T), w = b % (T / 2);
      const int q = lm.groups > 1 ? (int)(32 * w / g) : 0;
      idx[l] = (int32_t)r;
      for (int t = 0; t < 4; ++t) sel[t][l] = t == q ? -1 : 0;
    }
    lm.idx[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    for (int t = 0; t < 4; ++t) lm.sel[v][t] = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sel[t])));
  }
  return lm;
}

struct Vec : Vec256 {  // the tiled kernel's traits (int4_tiled_dot.inc) on simd.h's arithmetic
  static constexpr int kMaxMB = 2;
  // u 2^(4q) is exact in float and below 2^31 for q < 7; nibble 7 would turn negative, so it is shifted down.
  static constexpr int kPrescaledNibbles = 7;
  struct Ctx {};
  static F nibble(const Ctx&, I w, int q) {
    if (q == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xF << (4 * q))));
  }
  // The 8 rows' scales of one group.
  static __m256 load_scales(const Int4Args& p, int64_t gi, int64_t i) {
    __m256 h[2];
    load_sz(p, gi, i, h);
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m256 lo = _mm256_permutevar8x32_ps(h[0], even), hi = _mm256_permutevar8x32_ps(h[1], even);
    return _mm256_blend_ps(lo, hi, 0xF0);
  }
  // Note [g = 32 lane scales]: at T = 8 and g = 32 a chunk has 4 groups and lane l of every vector is in
  // group l % 4 (w = l % 4), so a vector's scales are the quad (s_r0, s_r1, s_r2, s_r3) of its row r in
  // every 128-bit lane. Transposing the 4 groups' row vectors into row quads once per chunk (8 shuffles)
  // and broadcasting a quad per vector (1 shuffle) replaces picking from 4 vectors per vector (4 permutes
  // and 3 blends on AVX2, 2 two-source permutes and a blend on AVX-512), which made g = 32 cost far more
  // per byte than g = 128.
  struct Scales {
    __m256 s[4];      // group q: rows 0..7
    __m256 quads[4];  // quads[u]: rows u (low half) and u + 4 (high half), one group per lane of the quad
    const float* rs;  // T = 8, one group: (s0, z0, ..., s7, z7) as float32, stored or copied to the caller's buf
  };
  template <int T, int NG>
  static Scales chunk_scales(const Int4Args& p, int64_t g0, int64_t i, float* buf) {
    Scales sc;
    sc.rs = nullptr;
    if constexpr (T == 8 && NG == 1) {  // lane_scale broadcasts from memory (see the AVX-512 Vec)
      if (p.szt == SzType::kF32) {
        sc.rs = static_cast<const float*>(p.sz) + g0 * p.lds + 16 * (i - p.sz_i0);
      } else {
        __m256 h[2];
        load_sz(p, g0, i, h);
        _mm256_storeu_ps(buf, h[0]);
        _mm256_storeu_ps(buf + 8, h[1]);
        sc.rs = buf;
      }
      return sc;
    }
    for (int q = 0; q < NG; ++q) sc.s[q] = load_scales(p, g0 + q, i);
    if constexpr (T == 8 && NG == 4) {
      const __m256 t0 = _mm256_unpacklo_ps(sc.s[0], sc.s[1]), t1 = _mm256_unpacklo_ps(sc.s[2], sc.s[3]);
      const __m256 t2 = _mm256_unpackhi_ps(sc.s[0], sc.s[1]), t3 = _mm256_unpackhi_ps(sc.s[2], sc.s[3]);
      sc.quads[0] = _mm256_shuffle_ps(t0, t1, 0x44);
      sc.quads[1] = _mm256_shuffle_ps(t0, t1, 0xEE);
      sc.quads[2] = _mm256_shuffle_ps(t2, t3, 0x44);
      sc.quads[3] = _mm256_shuffle_ps(t2, t3, 0xEE);
    }
    return sc;
  }
  template <int T, int NG>
  static F lane_scale(const LaneMap& lm, const Scales& sc, int v) {
    if constexpr (T == 8 && NG == 1) return _mm256_set1_ps(sc.rs[2 * (v / 2)]);  // vector v: half of row v / 2
    if constexpr (T == 8 && NG == 4) {  // vector v holds words of row v / 2
      const int r = v / 2;
      const __m256 u = sc.quads[r % 4];
      return r < 4 ? _mm256_permute2f128_ps(u, u, 0x00) : _mm256_permute2f128_ps(u, u, 0x11);
    }
    F s = _mm256_permutevar8x32_ps(sc.s[0], lm.idx[v]);
    for (int q = 1; q < NG; ++q)
      s = _mm256_blendv_ps(s, _mm256_permutevar8x32_ps(sc.s[q], lm.idx[v]), lm.sel[v][q]);
    return s;
  }
  template <int MB>
  static void zero_terms(const Int4Args& p, int64_t i, int64_t m0, float (*zt)[8]) {
    __m256 zacc[MB][2];
    for (int m = 0; m < MB; ++m) zacc[m][0] = zacc[m][1] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < p.G; ++gi) {
      __m256 h[2];
      load_sz(p, gi, i, h);
      for (int m = 0; m < MB; ++m) {
        const __m256 sx = _mm256_set1_ps(p.sx[(m0 + m) * p.G + gi]);
        zacc[m][0] = _mm256_fmadd_ps(h[0], sx, zacc[m][0]);
        zacc[m][1] = _mm256_fmadd_ps(h[1], sx, zacc[m][1]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      alignas(32) float zl[16];
      _mm256_store_ps(zl, zacc[m][0]);
      _mm256_store_ps(zl + 8, zacc[m][1]);
      for (int r = 0; r < 8; ++r) zt[m][r] = zl[2 * r + 1] - 8.f * zl[2 * r];
    }
  }
};

#include "int4_tiled_dot.inc"

// The AVX-512 dequant_tiles at 8 lanes, for the sgemm prefill (Note [int4 prefill below AVX-512]): n-tiles [i0, i1)
// -> fp32 rows dst[8 (i - i0) + r][kk], kk = 16 T j + 2 T q + l for word l of row r and nibble q (the permuted k
// order; the activation is permuted to match). A word's group within its chunk depends on its lane only: its k
// (k_of) is 32 (l % (T / 2)) plus less than 32.
void dequant_tiles(const Int4Args& p, int64_t i0, int64_t i1, float* dst, int64_t ldd) {
  const int64_t T = p.T, chunk = 16 * T, words = 2 * T, ng = std::max<int64_t>(1, chunk / p.g);
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const __m256 eight = _mm256_set1_ps(8.f);
  int lane_group[16];
  for (int64_t l = 0; l < words; ++l) lane_group[l] = ng == 1 ? 0 : (int)((l % (T / 2)) * 32 / p.g);
  for (int64_t i = i0; i < i1; ++i) {
    float* rows = dst + 8 * (i - i0) * ldd;
    for (int64_t j = 0; j < p.NC; ++j) {
      const int64_t g0 = chunk * j / p.g;
      float s[8][4], z[8][4];
      for (int r = 0; r < 8; ++r)
        for (int64_t t = 0; t < ng; ++t) {
          s[r][t] = sz_at(p, g0 + t, 8 * i + r, 0);
          z[r][t] = sz_at(p, g0 + t, 8 * i + r, 1);
        }
      const int32_t* blk = p.q + i * p.ldq + j * chunk;
      for (int64_t u = 0; u < 2 * T; ++u) {  // 8 words: word b = 8 u + e is lane l = b % 2T of row b / 2T
        alignas(32) float sv[8], zv[8];
        for (int e = 0; e < 8; ++e) {
          const int64_t b = 8 * u + e, r = b / words, l = b % words;
          sv[e] = s[r][lane_group[l]];
          zv[e] = z[r][lane_group[l]];
        }
        const __m256 sc = _mm256_load_ps(sv), ze = _mm256_load_ps(zv);
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 * u));
        const int64_t b0 = 8 * u, r0 = b0 / words, l0 = b0 % words;
        for (int q = 0; q < 8; ++q) {
          const __m256 code = _mm256_sub_ps(
              _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(wv, 4 * q), nibble)), eight);
          const __m256 val = _mm256_fmadd_ps(code, sc, ze);
          float* at = rows + r0 * ldd + chunk * j + words * q + l0;
          if (words >= 8) {
            _mm256_storeu_ps(at, val);
          } else {  // T = 2: 4 words a row, two rows per vector
            _mm_storeu_ps(at, _mm256_castps256_ps128(val));
            _mm_storeu_ps(at + ldd, _mm256_extractf128_ps(val, 1));
          }
        }
      }
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options

// The AVX-VNNI decode on int16 pairs (Note [int4 decode on int16 pairs]), VEX and EVEX as Note [AVX-VNNI kernels].
#define I16_NS avx_vnni
#define I16_TARGET _Pragma("GCC target(\"avx2,fma,f16c,avxvnni\")")
#define I16_DPWSSD _mm256_dpwssd_avx_epi32
#include "int4_tiled_dot_int16.inc"
#define I16_NS avx_vnni_evex
#define I16_TARGET _Pragma("GCC target(\"avx2,fma,f16c,avx512vl,avx512vnni\")")
#define I16_DPWSSD _mm256_dpwssd_epi32
#include "int4_tiled_dot_int16.inc"

// ================================================================================================
// AVX-512 F/BW/VL/DQ: 16 words (128 nibbles) per zmm; nibble -> float by vpermps from a 16-entry table.
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {

// 16 floats (s0, z0, ..., s7, z7): the 8 rows of n-tile i in group gi.
inline __m512 load_sz(const Int4Args& p, int64_t gi, int64_t i) {
  const int64_t off = gi * p.lds + 16 * (i - p.sz_i0);
  switch (p.szt) {
    case SzType::kF32: return _mm512_loadu_ps(static_cast<const float*>(p.sz) + off);
    case SzType::kBF16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.sz) + off));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    default:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.sz) + off)));
  }
}

// Per-lane indices into the (s, z) vectors of the chunk's groups: lane word b = 16 v + l has row
// r = b / 2T and group q = 32 w / g within the chunk (0..3). idx = 2 r + 16 (q & 1); hi = lanes with q >= 2.
struct LaneMap {
  __m512i idx[8];
  __mmask16 hi[8];
  int groups;  // groups per chunk: 1, 2 or 4
};

LaneMap lane_map(int64_t T, int64_t g) {
  LaneMap lm;
  const int64_t chunk = 16 * T;
  lm.groups = (int)std::max<int64_t>(1, chunk / g);
  for (int v = 0; v < T; ++v) {
    alignas(64) int32_t idx[16];
    uint32_t hi = 0;
    for (int l = 0; l < 16; ++l) {
      const int64_t b = 16 * v + l, r = b / (2 * T), w = b % (T / 2);
      const int q = lm.groups > 1 ? (int)(32 * w / g) : 0;
      idx[l] = (int32_t)(2 * r + 16 * (q & 1));
      if (q >= 2) hi |= 1u << l;
    }
    lm.idx[v] = _mm512_load_si512(idx);
    lm.hi[v] = (__mmask16)hi;
  }
  return lm;
}

// Lane scales (e = 0) or zeros (e = 1) of zmm v from the chunk's group vectors sz[0..NG) (NG = lm.groups).
template <int NG>
inline __m512 lane_pick(const LaneMap& lm, const __m512* sz, int v, int e) {
  const __m512i idx = e ? _mm512_add_epi32(lm.idx[v], _mm512_set1_epi32(1)) : lm.idx[v];
  if constexpr (NG == 1) return _mm512_permutexvar_ps(idx, sz[0]);
  const __m512 a = _mm512_permutex2var_ps(sz[0], idx, sz[1]);
  if constexpr (NG == 2) return a;
  return _mm512_mask_blend_ps(lm.hi[v], a, _mm512_permutex2var_ps(sz[2], idx, sz[3]));
}

inline __m512 lane_pick(const LaneMap& lm, const __m512* sz, int v, int e) {  // NG known only at run time
  switch (lm.groups) {
    case 1: return lane_pick<1>(lm, sz, v, e);
    case 2: return lane_pick<2>(lm, sz, v, e);
    default: return lane_pick<4>(lm, sz, v, e);
  }
}

struct Vec : Vec512 {  // the tiled kernel's traits (int4_tiled_dot.inc) on simd.h's arithmetic
  static constexpr int kMaxMB = 4;
  // Note [int4 nibble decode]: nibble q >= 1 is masked in place and converted as an unsigned integer, u 2^(4q)
  // (exact in float for every q, up to 15 * 2^28), and the activation carries the 2^(-4q) (permute_activation);
  // nibble 0 is one vpermps from a 16-entry table (it reads the low 4 bits). 15 instructions per 16 words where
  // a shift + vpermps per nibble took 15 too, but vpermps and the shifts shared the shuffle pipes while the mask
  // runs on any vector pipe and the conversion beside the FMAs: at M = 1 the loop is bound by the vector pipes
  // (1 load, 15 decode, 8 FMA and the scale per 64 bytes), 1.1-1.2x the words per cycle on Zen 4.
  static constexpr int kPrescaledNibbles = 8;
  struct Ctx {  // an explicit constructor: an implicit one would not get this region's target
    __m512 table;
    Ctx() : table(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)) {}
  };
  static F nibble(const Ctx& c, I w, int q) {
    if (q == 0) return _mm512_permutexvar_ps(w, c.table);
    return _mm512_cvtepu32_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)(0xFu << (4 * q)))));
  }
  // See Note [g = 32 lane scales] (AVX2 above): at T = 8, g = 32 vector v is row v, lane l group l % 4.
  struct Scales {
    __m512 sz[4];     // group q: (s0, z0, ..., s7, z7)
    __m512 quads[2];  // quads[h] lane 4 r + q: scale of row 4 h + r, group q
    const float* rs;  // T = 8, one group: (s0, z0, ..., s7, z7) as float32, stored or copied to the caller's buf
  };
  template <int T, int NG>
  static Scales chunk_scales(const Int4Args& p, int64_t g0, int64_t i, float* buf) {
    Scales sc;
    for (int q = 0; q < NG; ++q) sc.sz[q] = load_sz(p, g0 + q, i);
    sc.rs = nullptr;
    if constexpr (T == 8 && NG == 1) {
      if (p.szt == SzType::kF32) {
        sc.rs = static_cast<const float*>(p.sz) + g0 * p.lds + 16 * (i - p.sz_i0);
      } else {
        _mm512_storeu_ps(buf, sc.sz[0]);
        sc.rs = buf;
      }
    }
    if constexpr (T == 8 && NG == 4) {
      // pairs lane 2 r + t: scale of row r, group t (of groups 0, 1 / 2, 3)
      const __m512i pair = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      const __m512 p01 = _mm512_permutex2var_ps(sc.sz[0], pair, sc.sz[1]);
      const __m512 p23 = _mm512_permutex2var_ps(sc.sz[2], pair, sc.sz[3]);
      const __m512i lo = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
      const __m512i hi = _mm512_setr_epi32(8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
      sc.quads[0] = _mm512_permutex2var_ps(p01, lo, p23);
      sc.quads[1] = _mm512_permutex2var_ps(p01, hi, p23);
    }
    return sc;
  }
  template <int T, int NG>
  static F lane_scale(const LaneMap& lm, const Scales& sc, int v) {
    if constexpr (T == 8 && NG == 4) {
      const __m512 u = sc.quads[v / 4];
      switch (v % 4) {  // the shuffle's immediate must be a literal
        case 0: return _mm512_shuffle_f32x4(u, u, 0x00);
        case 1: return _mm512_shuffle_f32x4(u, u, 0x55);
        case 2: return _mm512_shuffle_f32x4(u, u, 0xAA);
        default: return _mm512_shuffle_f32x4(u, u, 0xFF);
      }
    }
    // T = 8, one group: vector v is row v, a broadcast. From memory it is a load, not one more instruction on
    // the vector pipes that bound the loop: 7% faster per word than the permute.
    if constexpr (T == 8 && NG == 1) return _mm512_set1_ps(sc.rs[2 * v]);
    return lane_pick<NG>(lm, sc.sz, v, 0);
  }
  // (s, z) vectors of every group times the group sums of x; lanes 2 r = s, 2 r + 1 = z.
  // code_offset: the value a code of 0 stands for beyond its midpoint 8 (136 for the bf16 kernel's 128 + u).
  template <int MB>
  static void zero_terms(const Int4Args& p, int64_t i, int64_t m0, float (*zt)[8], float code_offset = 8.f) {
    // Two chains per token: one FMA chain of G = 20 (K = 576, g = 32) was 80 cycles of latency per tile.
    __m512 zacc[MB][2];
    for (int m = 0; m < MB; ++m) zacc[m][0] = zacc[m][1] = _mm512_setzero_ps();
    int64_t gi = 0;
    for (; gi + 2 <= p.G; gi += 2)
      for (int h = 0; h < 2; ++h) {
        const __m512 szv = load_sz(p, gi + h, i);
        for (int m = 0; m < MB; ++m)
          zacc[m][h] = _mm512_fmadd_ps(szv, _mm512_set1_ps(p.sx[(m0 + m) * p.G + gi + h]), zacc[m][h]);
      }
    if (gi < p.G) {
      const __m512 szv = load_sz(p, gi, i);
      for (int m = 0; m < MB; ++m) zacc[m][0] = _mm512_fmadd_ps(szv, _mm512_set1_ps(p.sx[(m0 + m) * p.G + gi]), zacc[m][0]);
    }
    for (int m = 0; m < MB; ++m) {
      alignas(64) float zl[16];
      _mm512_store_ps(zl, _mm512_add_ps(zacc[m][0], zacc[m][1]));
      for (int r = 0; r < 8; ++r) zt[m][r] = zl[2 * r + 1] - code_offset * zl[2 * r];
    }
  }
};

#include "int4_tiled_dot.inc"

// Prefill: n-tiles [i0, i1) x chunks [j0, j1) -> fp32 rows dst[8 (i - i0) + r][kk], kk = 16 T (j - j0) +
// 2 T q + (b % 2T): the permuted k order of Note [int4 prefill] (the activation is permuted the same way).
template <int T>
void dequant_tiles_t(const Int4Args& p, int64_t i0, int64_t i1, int64_t j0, int64_t j1, float* dst, int64_t ldd) {
  const LaneMap lm = lane_map(T, p.g);
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  constexpr int64_t chunk = 16 * T;
  for (int64_t i = i0; i < i1; ++i) {
    float* rows = dst + 8 * (i - i0) * ldd;
    for (int64_t j = j0; j < j1; ++j) {
      __m512 sz[4];
      const int64_t g0 = chunk * j / p.g;
      for (int q = 0; q < lm.groups; ++q) sz[q] = load_sz(p, g0 + q, i);
      const int32_t* blk = p.q + i * p.ldq + j * chunk;
      for (int v = 0; v < T; ++v) {
        const __m512i wv = _mm512_loadu_si512(blk + 16 * v);
        const __m512 s = lane_pick(lm, sz, v, 0), z = lane_pick(lm, sz, v, 1);
        for (int q = 0; q < 8; ++q) {
          const __m512 val = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(wv, 4 * q), table), s, z);
          const int64_t col = chunk * (j - j0) + 2 * T * q;
          if (T == 8) {
            _mm512_storeu_ps(rows + v * ldd + col, val);
          } else if (T == 4) {
            _mm256_storeu_ps(rows + (2 * v) * ldd + col, _mm512_castps512_ps256(val));
            _mm256_storeu_ps(rows + (2 * v + 1) * ldd + col, _mm512_extractf32x8_ps(val, 1));
          } else {
            _mm_storeu_ps(rows + (4 * v) * ldd + col, _mm512_castps512_ps128(val));
            _mm_storeu_ps(rows + (4 * v + 1) * ldd + col, _mm512_extractf32x4_ps(val, 1));
            _mm_storeu_ps(rows + (4 * v + 2) * ldd + col, _mm512_extractf32x4_ps(val, 2));
            _mm_storeu_ps(rows + (4 * v + 3) * ldd + col, _mm512_extractf32x4_ps(val, 3));
          }
        }
      }
    }
  }
}

void dequant_tiles(const Int4Args& p, int64_t i0, int64_t i1, int64_t j0, int64_t j1, float* dst, int64_t ldd) {
  switch (p.T) {
    case 8: return dequant_tiles_t<8>(p, i0, i1, j0, j1, dst, ldd);
    case 4: return dequant_tiles_t<4>(p, i0, i1, j0, j1, dst, ldd);
    default: return dequant_tiles_t<2>(p, i0, i1, j0, j1, dst, ldd);
  }
}

}  // namespace avx512
#pragma GCC pop_options

// ================================================================================================
// AVX-512 + AVX512-BF16: bf16 activations, decode (Note [int4 bf16 decode]) and prefill (Note [int4 tiled in bf16])
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace avx512_bf16 {
#include "int4_tiled_dot_bf16.inc"
#include "int4_tiled_bf16.h"
}  // namespace avx512_bf16
#pragma GCC pop_options

// ================================================================================================
// Glue: checks, activation permutation, threads.
// ================================================================================================
constexpr int64_t kPrefillMinM = 32;  // AVX-512 from here (measured with benchmarks/bench_linear.py)
constexpr int64_t kPrefillTiles = 24;  // n-tiles per work item at most: 192 rows = 32 micro-tiles of 6 rows
constexpr int64_t kPrefillKc = 256;   // k per panel: 256 x 32 fp32 = 32 KiB
constexpr int64_t kBf16BlockRows = 64;  // rows per parallel task of the bf16 prefill (two 32-row panels)

void prefill_bf16(const Int4Args& p, const at::Tensor& x, int planes) {
  const int64_t Kt = p.NC * 16 * p.T;
  const at::Tensor x2 = x.reshape({p.M, p.K});
  const Bf16Activations a = bf16_activations(x2, Kt, planes, amx_selected());
  const at::Tensor xsum = group_sums(x2, planes, p.G, p.g);
  const int64_t rows = balanced_rows(p.N, kBf16BlockRows, 32);
  at::parallel_for(0, (p.N + rows - 1) / rows, 1, [&](int64_t b0, int64_t b1) {
    avx512_bf16::prefill(p, a, xsum.data_ptr<float>(), b0 * rows, std::min(b1 * rows, p.N));
  });
}


// xp[m][j][q][l] = x[m][k_of(T, j, l, q)] * f[q] (0 past K); sx[m][gi] = sum of x[m] over group gi.
// f[q] = 2^(-4q) for q < prescaled (the vector decoders read nibble q as u 2^(4q): Vec::kPrescaledNibbles), else
// 1: exact, unless a |x| below 2^-98 loses bits as a subnormal.
// A chunk's gather pattern, the same for every chunk: off = k - 16 T j of (q, l), f the factor of nibble q.
// Built once per (T, prescaled) and kept: computing it per call (k_of's divisions by a run-time T, ldexp) cost
// about 1 us of an M = 1 call.
struct PermuteTable {
  int32_t off[128];
  float f[128];
};

const PermuteTable& permute_table(int64_t T, int prescaled) {
  static const std::vector<PermuteTable> tables = [] {
    std::vector<PermuteTable> t(3 * 9);
    for (int ti = 0; ti < 3; ++ti)
      for (int pre = 0; pre <= 8; ++pre) {
        PermuteTable& pt = t[ti * 9 + pre];
        for (int q = 0; q < 8; ++q)
          for (int64_t l = 0; l < 16; ++l) {
            pt.off[16 * q + l] = (int32_t)k_of(2 << ti, 0, l, q);
            pt.f[16 * q + l] = q < pre ? std::ldexp(1.f, -4 * q) : 1.f;
          }
      }
    return t;
  }();
  const int ti = T == 2 ? 0 : T == 4 ? 1 : 2;
  return tables[ti * 9 + prescaled];
}

// x rounded to bfloat16 (nearest even; NaN kept): what float32 activations become where torch allows bf16 matmuls.
inline float bf16_rounded(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return v;
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &u, 4);
  return v;
}

// One row of permute_activation; each ISA passes its vector chunk gather and group sum (always_inline into the
// functions under the target pragmas below). The plain loops (a scalar load per element, a dependent add per element
// of the sums) took 0.7 us at K = 576 and 1.7 us at K = 1536 of every M = 1 call, before its parallel region starts;
// the vector ones 0.3 us at K = 576 (Note [int4 call overhead]; rdtsc around the call, SmolLM2 decode, Intel Xeon).
// full_chunk(xc, pt, dst): dst[i] = xc[pt.off[i]] * pt.f[i] for i < 128 (GCC does not turn it into gathers);
// group_sum(v, n): v[0] + ... + v[n - 1], in the ISA's vector lanes. The two lambdas are written per ISA, not once
// over simd.h's Vec in an included file: that version (same instructions) made the float32 decode at 4096^2 g128
// M = 1 run 0.58-0.60 ms instead of 0.51-0.54 (bench_linear.py --formats int4 --ms 1, three runs each; code
// placement of the dot kernel, which that file changed), so it was not kept.
template <typename FullChunk, typename GroupSum>
__attribute__((always_inline)) inline void permute_row(const float* xr, int64_t K, int64_t T, int64_t NC,
                                                       int64_t g, int64_t G, const PermuteTable& pt, float* xp,
                                                       float* sx, const FullChunk& full_chunk,
                                                       const GroupSum& group_sum) {
  const int32_t* off = pt.off;
  const float* f = pt.f;
  for (int64_t j = 0; j < NC; ++j) {
    float* dst = xp + j * 128;
    const int64_t k0 = 16 * T * j;
    const float* xc = xr + k0;
    if (k0 + 16 * T <= K) {
      full_chunk(xc, pt, dst);
    } else {
      for (int i = 0; i < 128; ++i) dst[i] = k0 + off[i] < K ? xc[off[i]] * f[i] : 0.f;
    }
  }
  for (int64_t gi = 0; gi < G; ++gi) sx[gi] = group_sum(xr + gi * g, std::min(K, (gi + 1) * g) - gi * g);
}

template <typename FullChunk, typename GroupSum>
__attribute__((always_inline)) inline void permute_rows_with(const float* x, int64_t m0, int64_t m1, int64_t K,
                                                             int64_t T, int64_t NC, int64_t g, int64_t G,
                                                             const PermuteTable& pt, float* xp, float* sx,
                                                             const FullChunk& full_chunk,
                                                             const GroupSum& group_sum) {
  for (int64_t m = m0; m < m1; ++m)
    permute_row(x + m * K, K, T, NC, g, G, pt, xp + m * NC * 128, sx + m * G, full_chunk, group_sum);
}

namespace scalar {
void permute_rows(const float* x, int64_t m0, int64_t m1, int64_t K, int64_t T, int64_t NC, int64_t g, int64_t G,
                  const PermuteTable& pt, float* xp, float* sx) {
  auto full_chunk = [](const float* xc, const PermuteTable& t, float* dst) {
    for (int i = 0; i < 128; ++i) dst[i] = xc[t.off[i]] * t.f[i];
  };
  auto group_sum = [](const float* v, int64_t n) {
    float sum = 0.f;
    for (int64_t k = 0; k < n; ++k) sum += v[k];
    return sum;
  };
  permute_rows_with(x, m0, m1, K, T, NC, g, G, pt, xp, sx, full_chunk, group_sum);
}
}  // namespace scalar
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
void permute_rows(const float* x, int64_t m0, int64_t m1, int64_t K, int64_t T, int64_t NC, int64_t g, int64_t G,
                  const PermuteTable& pt, float* xp, float* sx) {
  auto full_chunk = [](const float* xc, const PermuteTable& t, float* dst) {
    for (int i = 0; i < 128; i += 8) {
      const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.off + i));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_i32gather_ps(xc, o, 4), _mm256_loadu_ps(t.f + i)));
    }
  };
  auto group_sum = [](const float* v, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(v + k));
    float sum = hsum(acc);
    for (; k < n; ++k) sum += v[k];
    return sum;
  };
  permute_rows_with(x, m0, m1, K, T, NC, g, G, pt, xp, sx, full_chunk, group_sum);
}
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
void permute_rows(const float* x, int64_t m0, int64_t m1, int64_t K, int64_t T, int64_t NC, int64_t g, int64_t G,
                  const PermuteTable& pt, float* xp, float* sx) {
  auto full_chunk = [](const float* xc, const PermuteTable& t, float* dst) {
    for (int i = 0; i < 128; i += 16) {
      const __m512i o = _mm512_loadu_si512(t.off + i);
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_i32gather_ps(o, xc, 4), _mm512_loadu_ps(t.f + i)));
    }
  };
  auto group_sum = [](const float* v, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(v + k));
    if (k < n) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - k)) - 1), v + k));
    return _mm512_reduce_add_ps(acc);
  };
  permute_rows_with(x, m0, m1, K, T, NC, g, G, pt, xp, sx, full_chunk, group_sum);
}
}  // namespace avx512
#pragma GCC pop_options

// round_bf16: read x as bf16-rounded values (both xp and the group sums sx), for fp32 activations in the bf16 kernel.
void permute_activation(const float* x, int64_t M, int64_t K, int64_t T, int64_t NC, int64_t g, int64_t G,
                        int prescaled, Isa isa, float* xp, float* sx, bool round_bf16 = false) {
  thread_local AlignedVector<float> rounded;  // M = 1..31 rows of K, reused: no allocation per decode call
  if (round_bf16) {
    if (rounded.size() < (size_t)(M * K)) rounded.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) rounded[i] = bf16_rounded(x[i]);
    x = rounded.data();
  }
  const PermuteTable& pt = permute_table(T, prescaled);
  auto rows = [&](int64_t m0, int64_t m1) {
    switch (isa) {
      case Isa::kAvx512Vnni: return avx512::permute_rows(x, m0, m1, K, T, NC, g, G, pt, xp, sx);
      case Isa::kAvx2: return avx2::permute_rows(x, m0, m1, K, T, NC, g, G, pt, xp, sx);
      default: return scalar::permute_rows(x, m0, m1, K, T, NC, g, G, pt, xp, sx);
    }
  };
  if (M <= 4) return rows(0, M);  // no parallel region to enter for a few tokens
  at::parallel_for(0, M, 4, rows);
}

// Note [int4 prefill]: out^T = W' @ x'^T with the roles of the int8 weight-only panel kernel swapped:
// the dequantized weight rows (192 per work item, 256 k at a time, fp32, permuted k order; the slab
// stays in L2) are its broadcast operand and the permuted activation, packed in panels of 32 tokens
// [Kt][32], its vector operand. Tokens go kPrefillMc at a time so that the accumulators ct[rows][Mc]
// (tokens contiguous, transposed into out at the end) stay in L2: with all M tokens at once they spilled
// to L3 from M ~ 1000 and MiniLM's batches ran at 0.4-0.7x fp32. A weight is dequantized once per chunk
// of tokens (about 1% of the chunk's FMAs).
constexpr int64_t kPrefillMc = 256;

// xt[mp][kk][t] = x[32 mp + t][k] with kk = 16 T j + 2 T q + l for k = k_of(T, j, l, q) (the order
// dequant_tiles writes); zero for tokens >= M and k >= K.
at::Tensor pack_activation_panels(const at::Tensor& x2, int64_t T, int64_t NC) {
  const int64_t M = x2.size(0), K = x2.size(1), chunk = 16 * T, Kt = NC * chunk, Mp = (M + 31) / 32 * 32;
  std::vector<int64_t> src(Kt);
  for (int64_t j = 0; j < NC; ++j)
    for (int q = 0; q < 8; ++q)
      for (int64_t l = 0; l < 2 * T; ++l) {
        const int64_t k = k_of(T, j, l, q);
        src[chunk * j + 2 * T * q + l] = k < K ? k : -1;
      }
  at::Tensor xt = at::empty({Mp / 32, Kt, 32}, x2.options());
  const float* x = x2.data_ptr<float>();
  float* dst = xt.data_ptr<float>();
  at::parallel_for(0, Mp / 32, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t mp = p0; mp < p1; ++mp) {
      float* d = dst + mp * Kt * 32;
      for (int64_t t = 0; t < 32; ++t) {
        const int64_t m = 32 * mp + t;
        const float* xr = x + m * K;
        for (int64_t kk = 0; kk < Kt; ++kk) d[kk * 32 + t] = (m < M && src[kk] >= 0) ? xr[src[kk]] : 0.f;
      }
    }
  });
  return xt;
}

void prefill(const Int4Args& p, const at::Tensor& x2, at::Tensor& out) {
  const int64_t M = x2.size(0), Kt = p.NC * 16 * p.T, Mp = (M + 31) / 32 * 32;
  const int64_t ldw = kPrefillKc + 16;  // not a multiple of 4 KiB: a micro-tile's 6 rows don't alias in L1
  const int64_t chunk = 16 * p.T;
  const at::Tensor xt = pack_activation_panels(x2, p.T, p.NC);  // (Mp / 32, Kt, 32)
  const float* xtp = xt.data_ptr<float>();
  // Work items balanced over the threads: with a fixed 24 n-tiles, N = 192 (SmolLM2's k / v projections) was one item
  // on one thread (0.85-0.90x fp32 at M = 64-256), N = 576 three on two.
  const int64_t tiles = balanced_rows(p.NT, kPrefillTiles, 1), nblocks = (p.NT + tiles - 1) / tiles;
  const int64_t mc = std::min(kPrefillMc, Mp);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    AlignedVector<float> wf(tiles * 8 * ldw), ct(tiles * 8 * mc);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t i0 = blk * tiles, i1 = std::min(p.NT, i0 + tiles), rows = 8 * (i1 - i0);
      for (int64_t m0 = 0; m0 < Mp; m0 += mc) {
        const int64_t mn = std::min(mc, Mp - m0);
        for (int64_t k0 = 0; k0 < Kt; k0 += kPrefillKc) {
          const int64_t kc = std::min(kPrefillKc, Kt - k0);  // whole chunks: 256 is a multiple of 16 T
          avx512::dequant_tiles(p, i0, i1, k0 / chunk, (k0 + kc) / chunk, wf.data(), ldw);
          for (int64_t mp = m0 / 32; mp < (m0 + mn) / 32; ++mp) {
            const float* panel = xtp + (mp * Kt + k0) * 32;
            for (int64_t r = 0; r < rows; r += 6)
              gemm_f32_6x32((int)std::min<int64_t>(6, rows - r), wf.data() + r * ldw, ldw, panel, kc,
                            ct.data() + r * mc + (32 * mp - m0), mc, 32, k0 == 0);
          }
        }
        // ct[r][m] -> out[m][n0 + r] in blocks of 16 x 16, each token's 16 outputs stored together. Row by row
        // (one column of out at a time) every store went to another line, and with N = 1536 (lines 6 KiB apart, two
        // L1 sets) each line was evicted before its next store: 384 x 1536 ran at 0.7x fp32, 384 x 1544 at 1.5x.
        const int64_t n0 = 8 * i0, nr = std::min(rows, p.N - n0), m1 = std::min(M, m0 + mn);
        for (int64_t rb = 0; rb < nr; rb += 16)
          for (int64_t mb = m0; mb < m1; mb += 16)
            for (int64_t m = mb; m < std::min(m1, mb + 16); ++m)
              for (int64_t r = rb; r < std::min(nr, rb + 16); ++r)
                p.out[m * p.ldo + n0 + r] = ct[r * mc + (m - m0)] + (p.bias ? p.bias[n0 + r] : 0.f);
      }
    }
  });
}

// Note [int4 prefill below AVX-512]: without AVX-512 this file has no fp32 panel micro-kernel, and the decode
// kernel (one pass per 1-2 tokens) re-decodes every weight byte M / 2 times: 18x slower than fp32 F.linear at
// M = 256 on AVX2. From kSgemmMinM tokens on, n-tiles are dequantized for an fp32 GEMM (prefill_dequantized in
// sgemm_prefill.h: ATen's sgemm, or the 256-bit panels from kPanels256MinM): in the
// permuted k order by vector code (avx2::dequant_tiles, the activation's columns permuted to match), or in natural
// order by the scalar level (dequant_natural). The scalar dequantization had cost 5-7 ms of a 4096^2 call (AVX2,
// Intel Xeon, 2 threads: M = 64 14.2 -> 11.1 ms, M = 256 31.5 -> 29.6 with the vector one; fp32 F.linear 8.1 / 24).
constexpr int64_t kSgemmMinM = 16;  // AVX2, 4096^2: M = 8 breaks even with the decode kernel, M = 32 is 3x faster
// The same route with the 256-bit panels as its GEMM (Note [fp32 panels at 256 bits]) starts later: the decode kernel
// has since been made faster, and it beat the panels up to M = 32 (AVX2, Zen 5, 2 threads, g128, ms decode / panels:
// 4096^2 M = 32 7.46 / 7.75, 4096 x 11008 M = 32 17.2 / 21.5; M = 48 a tie, 9.9 / 9.8 and 26.8 / 26.7).
constexpr int64_t kPanels256MinM = 48;
constexpr int64_t kAvx512SgemmMinM = 128;  // where the AVX-512 panels take it (Note [fp32 prefill by sgemm])

// For each column kk of a row dequantized in the permuted order (dequant_tiles): the k it holds (K and above are
// padding). The permutation stays within chunks of 16 T columns.
std::vector<int64_t> permuted_order(int64_t T, int64_t NC) {
  std::vector<int64_t> k(NC * 16 * T);
  for (int64_t j = 0; j < NC; ++j)
    for (int q = 0; q < 8; ++q)
      for (int64_t l = 0; l < 2 * T; ++l) k[16 * T * j + 2 * T * q + l] = k_of(T, j, l, q);
  return k;
}

// The same, -1 for padding: the column map of prefill_by_panels256, whose k blocks must hold whole chunks.
static_assert(kPanels256Kc % 128 == 0, "a k block of the 256-bit panels is whole chunks of 16 T k (T <= 8)");
std::vector<int32_t> natural_k(int64_t T, int64_t NC, int64_t K) {
  const std::vector<int64_t> order = permuted_order(T, NC);
  std::vector<int32_t> k(order.size());
  for (size_t kk = 0; kk < order.size(); ++kk) k[kk] = order[kk] < K ? (int32_t)order[kk] : -1;
  return k;
}

// x (M, K) -> (M, Kt) with column kk = 16 T j + 2 T q + l holding x[:, k_of(T, j, l, q)] (0 past K): the
// activation for rows dequantized in the permuted k order (dequant_tiles).
at::Tensor permuted_columns(const at::Tensor& x, int64_t T, int64_t NC) {
  const int64_t K = x.size(1), Kt = NC * 16 * T;
  const at::Tensor padded = Kt == K ? x : at::constant_pad_nd(x, {0, Kt - K}, 0);
  return padded.index_select(1, at::tensor(permuted_order(T, NC), at::kLong)).contiguous();
}

// n-tiles [i0, i1) -> dst[8 (i - i0) + r][k], k in natural order (Note [Tensor-core tiled int4]), row stride ldd.
void dequant_natural(const Int4Args& p, int64_t i0, int64_t i1, float* dst, int64_t ldd) {
  const int64_t T = p.T, chunk = 16 * T, ng = std::max<int64_t>(1, chunk / p.g);
  // Per (word, nibble) of a block: its k within the chunk and its group among the chunk's; computed once,
  // since k_of and / g with a run-time T and g cost more than the dequantization itself.
  int16_t koff[128][8];
  uint8_t grp[128][8];
  for (int64_t b = 0; b < chunk; ++b)
    for (int q = 0; q < 8; ++q) {
      koff[b][q] = (int16_t)k_of(T, 0, b, q);
      grp[b][q] = (uint8_t)(ng == 1 ? 0 : koff[b][q] / p.g);
    }
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t j = 0; j < p.NC; ++j) {
      const int64_t g0 = chunk * j / p.g;
      float s[8][4], z[8][4];  // the chunk's (at most 4) groups, for the tile's 8 rows
      for (int r = 0; r < 8; ++r)
        for (int64_t t = 0; t < ng; ++t) {
          s[r][t] = sz_at(p, g0 + t, 8 * i + r, 0);
          z[r][t] = sz_at(p, g0 + t, 8 * i + r, 1);
        }
      const int32_t* blk = p.q + i * p.ldq + j * chunk;
      for (int64_t r = 0; r < 8; ++r) {
        float* row = dst + (8 * (i - i0) + r) * ldd + chunk * j;
        for (int64_t b = 2 * T * r; b < 2 * T * (r + 1); ++b) {  // row r's words of the block
          const uint32_t word = (uint32_t)blk[b];
          for (int q = 0; q < 8; ++q) {
            const int t = grp[b][q];
            row[koff[b][q]] = (float)((int)((word >> (4 * q)) & 0xF) - 8) * s[r][t] + z[r][t];
          }
        }
      }
    }
  }
}

at::Tensor linear_int4wo_tiled_kernels(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale_and_zero,
                                       int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_int4wo_tiled";
  TORCH_CHECK(qdata.dim() == 4 && qdata.scalar_type() == at::kInt && qdata.size(2) == 32, op,
              ": qdata must be int32 tiles [N8/8][Kt/(16T)][32][T/2], got ", qdata.scalar_type(), " ", qdata.sizes());
  const int64_t NT = qdata.size(0), NC = qdata.size(1), T = 2 * qdata.size(3);
  TORCH_CHECK(T == 2 || T == 4 || T == 8, op, ": inner_k_tiles = 2 * qdata.size(3) must be 2, 4 or 8, got ", T);
  const int64_t g = group_size, Kt = NC * 16 * T, K = x.size(-1), N = out_features;
  TORCH_CHECK(g == 32 || g == 64 || g == 128 || g == 256, op, ": group_size must be 32, 64, 128 or 256, got ", g);
  TORCH_CHECK(Kt % g == 0, op, ": padded K = ", Kt, " is not a multiple of group_size ", g);
  TORCH_CHECK(K <= Kt && K > Kt - std::max(g, 16 * T), op, ": x has ", K, " features but the tiles hold ", Kt,
              " (padded) columns");
  TORCH_CHECK(N >= 1 && N <= 8 * NT, op, ": out_features ", N, " does not fit ", NT, " n-tiles of 8");
  TORCH_CHECK(scale_and_zero.dim() == 3 && scale_and_zero.size(0) == Kt / g && scale_and_zero.size(1) == 8 * NT &&
                  scale_and_zero.size(2) == 2, op, ": scale_and_zero must be [Kt/g][N8][2] = [", Kt / g, "][", 8 * NT,
              "][2], got ", scale_and_zero.sizes());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": activations must be float32, bfloat16 or float16, got ", dt);
  // Tiles: chunk blocks contiguous inside an n-tile (a slice along n-tiles keeps that); else a copy.
  const at::Tensor q = (qdata.stride(3) == 1 && qdata.stride(2) == T / 2 && qdata.stride(1) == 16 * T)
                           ? qdata : qdata.contiguous();
  const at::Tensor sz = (scale_and_zero.stride(2) == 1 && scale_and_zero.stride(1) == 2)
                            ? scale_and_zero : scale_and_zero.contiguous();
  // Note [int4 call overhead]: at M = 1 on SmolLM2's layers the kernel runs 3-30 us, so every tensor the glue
  // makes counts. A float32 contiguous x is read in place, out is made in its final shape (no reshape or cast
  // for float32), and the decode path's permuted activation lives in per-thread scratch (a vector that only
  // grows), not in two at::empty per call.
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape (", N, "), got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = K == 0 ? 0 : x.numel() / K, G = Kt / g;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kFloat));
  auto result = [&]() { return dt == at::kFloat ? out : out.to(dt); };
  if (M == 0) return result();
  Int4Args p{q.data_ptr<int32_t>(), NT, NC, T, q.stride(0), sz.data_ptr(), sz_type(sz.scalar_type(), op),
             sz.stride(0), g, G, K, N, nullptr, nullptr, M, b.defined() ? b.data_ptr<float>() : nullptr,
             out.data_ptr<float>(), N};
  // bf16 activations, and float32 ones when torch allows bf16 matmuls (Note [fp32 activations in bf16]), take the
  // AVX512-BF16 kernels: the prefill from kPrefillMinM (Note [int4 tiled in bf16]), below it the decode kernel at
  // inner_k_tiles 8 or 4 (Note [int4 bf16 decode]; tiling 2 converts x to fp32 like float16 does). Unlike the
  // other formats' decode kernels, this one is faster than its fp32 twin (1.6x per word at M = 1), which is why
  // float32 activations take it too.
  const Isa level = selected_isa_exact(), isa = base_isa(level);
  const bool fp32_as_bf16 = dt == at::kFloat && fp32_matmul_allows_bf16();
  const bool bf16 = level == Isa::kAvx512Bf16 && (dt == at::kBFloat16 || fp32_as_bf16);
  if (M >= kPrefillMinM && (bf16 || (level == Isa::kAvx512Bf16 && fp32_takes_amx_planes(dt)))) {
    prefill_bf16(p, x, bf16 ? 1 : 3);  // float32 on AMX: three planes (Note [fp32 activations on AMX])
    return result();
  }
  const bool x_ready = dt == at::kFloat && x.is_contiguous();
  const at::Tensor x2 = x_ready ? x : x.reshape({-1, K}).to(at::kFloat).contiguous();
  // Note [fp32 prefill by sgemm] (registration.cpp): where both the panels and rows dequantized for ATen's sgemm can
  // serve, the route measured fastest for the case; unmeasured, Intel CPUs take sgemm at the AVX-512 level from
  // kAvx512SgemmMinM tokens and at the AVX2 level from kSgemmMinM, the others the panels (AVX2: from kPanels256MinM).
  const bool intel = fp32_prefill_rule_sgemm();
  bool dequantize_rows = false, sgemm = true;
  if (isa == Isa::kAvx512Vnni && M >= kPrefillMinM) {
    dequantize_rows = sgemm = fp32_prefill_takes_sgemm(isa, intel && M >= kAvx512SgemmMinM);
    if (!sgemm) {
      prefill(p, x2.reshape({M, K}), out);
      return result();
    }
  } else if (isa != Isa::kAvx512Vnni && M >= kSgemmMinM) {
    sgemm = fp32_prefill_takes_sgemm(isa, intel);  // always at the scalar level
    dequantize_rows = sgemm || M >= kPanels256MinM;
  }
  if (dequantize_rows) {
    // Whole n-tiles of 8 rows: the buffer holds the last tile's padding rows, the GEMM reads the first N. The SIMD
    // levels dequantize in the permuted k order (vector code) and the activation's columns follow it; the scalar
    // level keeps the natural order.
    at::Tensor out2 = out.view({M, N});
    auto decode_tiles = [&](int64_t r0, int64_t r1, float* dst) {
      if (isa == Isa::kAvx512Vnni) avx512::dequant_tiles(p, r0 / 8, (r1 + 7) / 8, 0, NC, dst, Kt);
      else avx2::dequant_tiles(p, r0 / 8, (r1 + 7) / 8, dst, Kt);
    };
    if (!sgemm) {  // the 256-bit panels take the rows' columns in x's order: x as it is
      prefill_by_panels256(x2.reshape({M, K}), N, Kt, p.bias, out2, decode_tiles, natural_k(T, NC, K).data());
    } else if (isa != Isa::kScalar) {
      prefill_by_sgemm(permuted_columns(x2.reshape({M, K}), T, NC), N, Kt, 8, p.bias, out2, decode_tiles);
    } else {
      prefill_by_sgemm(x2.reshape({M, K}), N, Kt, 8, p.bias, out2, [&](int64_t r0, int64_t r1, float* dst) {
        dequant_natural(p, r0 / 8, (r1 + 7) / 8, dst, Kt);
      });
    }
    return result();
  }
  bool bf16_dot = bf16 && avx512_bf16::dot_tiles_take(T);
  // One float32 token on inner_k_tiles 8 or 4: the level's float32 dot kernel, the int16-pair integer one (Note [int4
  // decode on int16 pairs], int4_tiled_dot_int16.inc: the AVX-VNNI build, or its EVEX twin where the CPU has AVX-512
  // VNNI) or, where torch's fp32 matmul precision allows bf16, the bf16 one: the route measured fastest for the case
  // (Note [Routes chosen by measurement]); unmeasured, bf16 where allowed, else int16 at the AVX-VNNI level, else float.
  bool int16_dot = false;
  if (M == 1 && T >= 4 && dt == at::kFloat && (level == Isa::kAvxVnni || isa == Isa::kAvx512Vnni)) {
    unsigned candidates = route_bit(kFloatDecode) | route_bit(kInt16Decode);
    if (bf16_dot) candidates |= route_bit(kBf16Decode);
    const int rule = bf16_dot ? kBf16Decode : level == Isa::kAvxVnni ? kInt16Decode : kFloatDecode;
    const int route = take_route(RouteSite::kInt4Decode, candidates, rule);
    int16_dot = route == kInt16Decode;
    bf16_dot = route == kBf16Decode;
  }
  thread_local AlignedVector<float> scratch;  // Note [scratch on cache lines]
  const int64_t sx_len = (M * G + 15) / 16 * 16;  // the bf16 pairs after the group sums start on a line too
  const size_t need =
      (size_t)(M * NC * 128 + sx_len + (bf16_dot ? M * NC * 64 : 0) + (int16_dot ? NC * (16 * T + 1) : 0));
  if (scratch.size() < need) scratch.resize(need);
  float* xp = scratch.data();
  float* sx = xp + M * NC * 128;
  const int prescaled = bf16_dot || int16_dot     ? 0
                        : isa == Isa::kAvx512Vnni ? avx512::Vec::kPrescaledNibbles
                        : isa == Isa::kAvx2       ? avx2::Vec::kPrescaledNibbles : 0;
  permute_activation(x2.data_ptr<float>(), M, K, T, NC, g, G, prescaled, isa, xp, sx, bf16_dot && fp32_as_bf16);
  // The int16 pairs (16 T int32 a chunk) and the chunks' factors after the group sums.
  int32_t* pairs = reinterpret_cast<int32_t*>(sx + sx_len);
  float* fac = sx + sx_len + NC * 16 * T;
  const bool vex = int16_dot && avx_vnni_vex_selected();
  if (int16_dot && !(vex ? avx_vnni::int16_pairs(xp, T, NC, pairs, fac)
                         : avx_vnni_evex::int16_pairs(xp, T, NC, pairs, fac))) {
    int16_dot = false;  // an Inf / NaN or a tiny chunk: the float32 kernel, on its own (prescaled) permutation
    permute_activation(x2.data_ptr<float>(), M, K, T, NC, g, G,
                       isa == Isa::kAvx512Vnni ? avx512::Vec::kPrescaledNibbles : avx2::Vec::kPrescaledNibbles, isa,
                       xp, sx);
  }
  p.xp = xp;
  p.sx = sx;
  if (bf16_dot) {
    uint32_t* xb = reinterpret_cast<uint32_t*>(sx + sx_len);
    avx512_bf16::pack_bf16_pairs(xp, M * NC, xb);
    p.xb = xb;
  }
  auto run = [&](const Int4Args& a, int64_t i0, int64_t i1) {
    if (bf16_dot) return avx512_bf16::dot_tiles(a, i0, i1);
    if (int16_dot) return vex ? avx_vnni::int16_tiles(a, pairs, fac, i0, i1)
                              : avx_vnni_evex::int16_tiles(a, pairs, fac, i0, i1);
    switch (isa) {
      case Isa::kAvx512Vnni: return avx512::dot_tiles(a, i0, i1);
      case Isa::kAvx2: return avx2::dot_tiles(a, i0, i1);
      default: return scalar::dot_tiles(a, i0, i1);
    }
  };
  // Note [scales staged per block]: not for the scalar kernel, which reads the scales row by row. A thread's first
  // block reads the stored scales (a copy would wait for DRAM before any work), prefetching the second one's.
  const int64_t B = isa == Isa::kScalar ? 0 : scale_block_tiles(G, p.szt);
  auto tiles = [&](int64_t i0, int64_t i1) {
    if (B == 0) return run(p, i0, i1);
    thread_local AlignedVector<char> buf;
    const size_t need = (size_t)(staged_lds(p, B) * G * sz_bytes(p));
    if (buf.size() < need) buf.resize(need);
    for (int64_t b0 = i0, b1; b0 < i1; b0 = b1) {
      b1 = std::min(i1, b0 + B);
      Int4Args a = b0 == i0 ? p : stage_scales(p, b0, b1, B, buf.data());
      a.src = p.sz;
      a.lds_src = p.lds;
      a.blk0 = b0;
      a.nxt0 = b1;
      a.nxt1 = std::min(i1, b1 + B);
      run(a, b0, b1);
    }
  };
  if (NT <= 4 || at::get_num_threads() == 1) {  // no parallel region to wake for one work item
    tiles(0, NT);
  } else {
    at::parallel_for(0, NT, 4, tiles);
  }
  return result();
}

// The kernels under the routes measured for the case (Note [Routes chosen by measurement]).
at::Tensor linear_int4wo_tiled(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale_and_zero,
                               int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  const int64_t K = x.dim() >= 1 ? x.size(-1) : 0, M = K > 0 ? x.numel() / K : 0;
  const int64_t T = qdata.dim() == 4 ? 2 * qdata.size(3) : 0;
  // keyed by the level whose kernels run (AVX-VNNI has its own int16-pair decode; the AVX-512 levels share theirs)
  const Isa level = selected_isa_exact();
  const RouteCase c{"torchqkit::linear_int4wo_tiled", (int)(level == Isa::kAvxVnni ? level : base_isa(level)),
                    (int)x.scalar_type(), M, out_features, K, group_size * 16 + T};
  return measured_routes(c, [&] {
    return linear_int4wo_tiled_kernels(x, qdata, scale_and_zero, group_size, out_features, bias);
  });
}

// What kernels.status() says serves the op at each level (Note [Kernel descriptions] in kernel_descriptions.cpp).
const std::string kAvx2Description =
    "dot kernel (8 words per ymm, 2 tokens per pass) up to M = 47; from M = 48 n-tiles dequantized to fp32 (permuted k "
    "order, x permuted to match) 16 rows at a time into k-major panels + 6x16 FMA tiles, on Intel CPUs from M = 16 "
    "blocks of 512 rows dequantized the same way, then ATen's fp32 GEMM (" + kFp32PrefillPanels256 + ")";
const DescribeOp kDescribed(
    OpDescription("torchqkit::linear_int4wo_tiled")
        .at("avx512_vnni",
            "M < 32: tiled words streamed once per 4 tokens, nibbles -> fp32 by vpermps (dot kernel; one float32 "
            "token on inner_k_tiles 8 or 4: this or the avx_vnni level's int16-pair kernel, whichever the case "
            "measured faster: Note [Routes chosen by measurement]); M >= 32: n-tiles dequantized to fp32 + the 6x32 "
            "FMA panel micro-kernel, or blocks of 512 rows dequantized to fp32 (permuted k order, x permuted to "
            "match), then ATen's fp32 GEMM, whichever the case measured faster (unmeasured: the GEMM from M = 128 on "
            "Intel CPUs; " + kFp32PrefillSgemm + ")")
        .at("avx512_bf16",
            "bf16 activations: M < 32 (inner_k_tiles 8 or 4) nibble pairs made bf16 (128 + u) by one vpternlogd, 32 "
            "weights per vdpbf16ps, 4 tokens per pass (Note [int4 bf16 decode]); M >= 32 codes - 8 as exact bf16 in "
            "natural-k-order panels + 6x32 vdpbf16ps tiles, group scales per segment, zero points as sum_g xsum * z "
            "in fp32; float32 / float16 activations (and other tilings at M < 32): the avx512_vnni kernels")
        .at("avx_vnni",
            "M = 1 on inner_k_tiles 8 or 4, where the case measured it faster than the AVX2 kernel (unmeasured: "
            "always): the activation of each chunk (128 / 64 k) split exactly into two int16 "
            "halves of a fixed-point value (29 bits and a sign), nibble pairs x int16 pairs by vpdpwssd (VEX; EVEX on "
            "ymm where only AVX-512 VNNI exists), float32-accurate, 15 instructions per 64 weights instead of 24 (Note "
            "[int4 decode on int16 pairs]; a chunk with Inf / NaN or below 2^-98 takes the AVX2 kernel); else the AVX2 "
            "kernels: " + kAvx2Description)
        .at("avx2", kAvx2Description)
        .at("scalar",
            "plain loops (M >= 16: dequantized blocks + ATen's fp32 GEMM): the CPU has no AVX2+FMA, or "
            "TORCHQKIT_CPU_ISA forced it")
        .fp32_in_bf16("every M (M >= 32 at inner_k_tiles 2; one token: the kernel measured fastest, Note [Routes "
                      "chosen by measurement])", "M >= 32")
        .fp32_prefill_routes());

// A stack of experts (E, ...) of these tiles: rows [offs[g - 1], offs[g]) of x through expert g (Note [Grouped
// linear in C++], grouped_rows.h).
at::Tensor grouped_linear_int4wo_tiled(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                       const at::Tensor& scale_and_zero, int64_t group_size, int64_t out_features) {
  constexpr const char* op = "torchqkit::grouped_linear_int4wo_tiled";
  TORCH_CHECK(qdata.dim() == 5 && scale_and_zero.dim() == 4 && qdata.size(0) == scale_and_zero.size(0), op,
              ": qdata (E, N8/8, Kt/(16T), 32, T/2) and scale_and_zero (E, Kt/g, N8, 2) of the same E experts, got ",
              qdata.sizes(), " and ", scale_and_zero.sizes());
  return grouped_rows(op, x, offs, qdata.size(0), out_features, [&](const at::Tensor& rows, int64_t g) {
    return linear_int4wo_tiled(rows, qdata.select(0, g), scale_and_zero.select(0, g), group_size, out_features, {});
  });
}

const DescribeOp kGroupedInt4Described(
    grouped_description("torchqkit::grouped_linear_int4wo_tiled", "torchqkit::linear_int4wo_tiled"));

}  // namespace
}  // namespace torchqkit_cpu

TORCH_LIBRARY_IMPL(torchqkit, CPU, m) {
  m.impl("linear_int4wo_tiled", &torchqkit_cpu::linear_int4wo_tiled);
  m.impl("grouped_linear_int4wo_tiled", &torchqkit_cpu::grouped_linear_int4wo_tiled);
}
