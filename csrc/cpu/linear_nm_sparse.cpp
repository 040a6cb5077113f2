// CPU backend of torchqkit::linear_nm_sparse_wo: N:M sparse integer weights (NMSparseLayout, Note [N:M sparse
// storage] in torchqkit/layouts/nm_format.py) times float activations, reading only the kept codes and their
// positions. The op (schema, fake, reference) is defined in torchqkit/kernels/ops/linear_nm_sparse_wo.py.
//
// Note [Gathering activations by position]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The lanes of a step are kept entries of one row: with 2:4, 16 entries (AVX-512) cover 8 blocks = 32 columns, and
// entry e sits at column 4 (e / 2) + p_e, p_e its 2-bit position. The step's 16 positions are one 32-bit word of the
// positions row, broadcast from memory; a variable shift by 2 e and one vpternlogd (mask, OR the block base) give each
// lane its column, and one two-source permute (vpermt2ps) of the 32 activations gathers the 16 x values the kept
// entries multiply: no gather instruction, no dense weight. The codes are widened to floats (int8: a sign extension;
// int4: Note [Int4 lanes out of storage order]) and, per group, the sums of (u + o) x are scaled once (Note [Kept
// codes as (u + o) s + z]), then one FMA per entry and token. AVX2 takes 8 entries (16 columns) per step and gathers
// with two vpermps and a blend on bit 3 of the column. Per 32 columns of a row the kernel reads 16 + 4 bytes for int8
// (dense int8: 32) and 8 + 4 for int4 (dense: 16). Up to 2 tokens (4 without a float zero point) two rows run
// interleaved, so their accumulation chains overlap and they share the activation loads. Patterns other than 2:4, code
// widths other than 4 and 8 bits, groups that don't hold whole steps, and the scalar level run the same sums an entry
// at a time. From kMaxDotTokens tokens on, rows are decoded into dense float rows for an fp32 GEMM
// (prefill_dequantized): at AVX-512 a step's dequantized weights are expanded onto their columns by vexpandps under
// the kept-column mask, elsewhere a positions byte places the 4 entries of 2 blocks.
//
// Note [Kept codes as (u + o) s + z]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A kept entry stores u: the code itself for 8 bits, code - qmin (offset binary) below 8 bits. Per group, with s the
// scale, z the zero point and c = u + qmin the code, the oracle's w is c s (no zero point), (c - z) s (integer zero
// point) or (c - mid) s + z (float zero point, mid = the code midpoint). So w = (u + o) s [+ z] with o = qmin,
// qmin - z or qmin - mid, and u + o is an exact small integer. The row decoders compute exactly that: every weight
// is the dequantized weight bit for bit. The dot kernels sum (u + o) x over a group and multiply by s once, and add
// z times the group's sum of the gathered x: the same products, rounded in another order (a one-hot x still gives
// the dequantized weight exactly).
#include <ATen/ATen.h>
#include "parallel.h"
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#include "avx2_reduce.h"
#include "kernel_descriptions.h"
#include "kernels.h"
#include "sgemm_prefill.h"
#include "../common/aten_glue.h"

// GCC 12's AVX-512 headers initialise _mm512_undefined_* from themselves, which -Wall reports as maybe-uninitialized
// wherever such an intrinsic is inlined (GCC bug 105593); nothing here reads an uninitialized value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace torchqkit_cpu {
namespace {

constexpr const char* kOp = "torchqkit::linear_nm_sparse_wo";
constexpr int64_t kMaxDotTokens = 8;  // tokens per pass of the dot kernels (their accumulators are registers)

enum class ZeroDomain { kNone, kInt, kFloat };

// Unaligned, aliasing loads the compiler folds into broadcasts from memory (a load, no port-5 shuffle); a value first
// copied into a local register is broadcast by a shuffle instead.
typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;
typedef long long __attribute__((may_alias, aligned(1))) unaligned_i64;

struct NmArgs {
  const uint8_t* kept;       // (N, kept_bytes): codes (8 bits) or packed offset-binary fields
  int64_t kept_bytes;
  const uint8_t* positions;  // (N, pos_bytes): position_bits(m)-bit fields
  int64_t pos_bytes;
  const float* scale;        // (N / bn, G) contiguous
  const float* zero;         // same shape, or null
  int64_t G, g, bn;
  int n, m, bits, pbits;
  bool is_signed;
  ZeroDomain domain;
  float qmin, mid;           // the code offset of stored fields (0 for 8-bit codes) and the float-domain midpoint
  const float* x;            // (M, K) contiguous
  int64_t M, K, N;
  float* out;                // (M, N)
  const float* bias;         // (N) or null
};

// Group gi of row r: w = (u + off) * mul + add (Note [Kept codes as (u + o) s + z]).
struct GroupAffine {
  float off = 0.f, mul = 0.f, add = 0.f;
  float operator()(float u) const { return (u + off) * mul + add; }
};

inline GroupAffine group_affine(const NmArgs& a, int64_t r, int64_t gi) {
  const int64_t i = (r / a.bn) * a.G + gi;
  GroupAffine ga;
  ga.mul = a.scale[i];
  switch (a.domain) {
    case ZeroDomain::kNone: ga.off = a.qmin; break;
    case ZeroDomain::kInt: ga.off = a.qmin - a.zero[i]; break;
    case ZeroDomain::kFloat: ga.off = a.qmin - a.mid; ga.add = a.zero[i]; break;
  }
  return ga;
}

// Field j of a row's little-endian stream of `bits`-bit fields (Note [Packed intx bits]); bytes past the row's end
// are not read.
inline uint32_t field(const uint8_t* row, int64_t row_bytes, int64_t j, int bits) {
  const int64_t bit = j * bits, byte = bit >> 3;
  uint32_t w = row[byte];
  if (byte + 1 < row_bytes) w |= (uint32_t)row[byte + 1] << 8;
  return (w >> (bit & 7)) & ((1u << bits) - 1);
}

// Stored value u of kept entry j (Note [Kept codes as (u + o) s + z]).
inline float kept_value(const NmArgs& a, const uint8_t* row, int64_t j) {
  if (a.bits == 8) return a.is_signed ? (float)(int8_t)row[j] : (float)row[j];
  return (float)field(row, a.kept_bytes, j, a.bits);
}

// fn(column, dequantized weight) for every kept entry of row r, in storage order: any pattern, width and group size.
template <class Fn>
void for_each_kept(const NmArgs& a, int64_t r, Fn&& fn) {
  const int64_t E = a.K / a.m * a.n;
  const uint8_t* kr = a.kept + r * a.kept_bytes;
  const uint8_t* pr = a.positions + r * a.pos_bytes;
  GroupAffine ga;
  int64_t group = -1;
  for (int64_t j = 0; j < E; ++j) {
    const int64_t c0 = j / a.n * a.m;  // the block's first column: groups hold whole blocks
    if (c0 / a.g != group) ga = group_affine(a, r, group = c0 / a.g);
    fn(c0 + field(pr, a.pos_bytes, j, a.pbits), ga(kept_value(a, kr, j)));
  }
}

// Rows [r0, r1), an entry at a time.
void rows_scalar(const NmArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t t = 0; t < a.M; ++t) {
      const float* x = a.x + t * a.K;
      float y = 0.f;
      for_each_kept(a, r, [&](int64_t col, float w) { y += w * x[col]; });
      a.out[t * a.N + r] = y + (a.bias ? a.bias[r] : 0.f);
    }
}

// Dense dequantized rows [r0, r1) (zeros at pruned entries) for the prefill GEMM.
void decode_rows(const NmArgs& a, int64_t r0, int64_t r1, float* dst, int64_t ldd) {
  for (int64_t r = r0; r < r1; ++r) {
    float* d = dst + (r - r0) * ldd;
    std::fill(d, d + a.K, 0.f);
    for_each_kept(a, r, [&](int64_t col, float w) { d[col] = w; });
  }
}

// The dot kernel over vector traits (the namespaces below): F, kStep columns (kStep / 2 kept entries) per step,
// zero / set1 / bcast / add / sub / fma / hsum, load_x, gather_index and gather (Note [Gathering activations by
// position]), step_values (the stored values u as floats). DOMAIN: 0 no zero point, 1 integer, 2 float. Per group
// the sums of (u + o [- z]) x are scaled once per row and token; a float zero point adds z times the sum of the
// gathered x (Note [Kept codes as (u + o) s + z]). Two rows run interleaved at M = 1 (their chains overlap), one row
// with more tokens (the accumulators stay in registers).
#define TQK_NM_ROWS                                                                                                    \
  template <int BITS, bool SIGNED, int DOMAIN, int M>                                                                  \
  void rows_dot(const NmArgs& a, int64_t r0, int64_t r1) {                                                             \
    /* two rows share each token's activations while the accumulators fit the 32 registers */                      \
    constexpr int R = (M <= 2 || (M <= 4 && DOMAIN != 2)) ? 2 : 1;                                                     \
    constexpr bool kOffset = BITS < 8 || DOMAIN == 2; /* o = 0 for 8-bit codes without a float zero point */          \
    const int64_t steps = a.K / kStep, spg = a.g / kStep;                                                              \
    const F off = set1(DOMAIN == 2 ? a.qmin - a.mid : a.qmin);                                                         \
    for (int64_t rb = r0; rb < r1; rb += R) {                                                                          \
      const int rows = (int)std::min<int64_t>(R, r1 - rb);                                                             \
      const uint8_t* kr[R];                                                                                            \
      const uint8_t* pr[R];                                                                                            \
      const float* sr[R];                                                                                              \
      const float* zr[R];                                                                                              \
      _Pragma("GCC unroll 8")                                                                                          \
      for (int i = 0; i < R; ++i) { /* a missing second row repeats the first (its sums are not stored) */           \
        const int64_t r = rb + std::min(i, rows - 1);                                                                  \
        kr[i] = a.kept + r * a.kept_bytes;                                                                             \
        pr[i] = a.positions + r * a.pos_bytes;                                                                         \
        sr[i] = a.scale + (r / a.bn) * a.G;                                                                            \
        zr[i] = a.zero ? a.zero + (r / a.bn) * a.G : nullptr;                                                          \
      }                                                                                                                \
      const int64_t ahead = kPfRows * a.kept_bytes, pahead = kPfRows * a.pos_bytes; /* rows ahead, same column */      \
      F out[R][M], outz[R][M];                                                                                         \
      _Pragma("GCC unroll 8")                                                                                          \
      for (int i = 0; i < R; ++i)                                                                                      \
        _Pragma("GCC unroll 8")                                                                                        \
        for (int t = 0; t < M; ++t) out[i][t] = outz[i][t] = zero();                                                   \
      for (int64_t gi = 0, st = 0; st < steps; ++gi) {                                                                 \
        F acc[R][M], accx[R][M];                                                                                       \
        _Pragma("GCC unroll 8")                                                                                        \
        for (int i = 0; i < R; ++i)                                                                                    \
          _Pragma("GCC unroll 8")                                                                                      \
          for (int t = 0; t < M; ++t) acc[i][t] = accx[i][t] = zero();                                                 \
        for (const int64_t end = st + spg; st < end; ++st) {                                                           \
          _Pragma("GCC unroll 8")                                                                                      \
          for (int i = 0; i < R; ++i) {                                                                                \
            if (st % kPrefetchEvery == 0)                                                                              \
              _mm_prefetch(reinterpret_cast<const char*>(kr[i] + st * (kStep * BITS / 16) + ahead), _MM_HINT_T1);  \
            if (st % (kPrefetchEvery * 2) == 0)                                                                        \
              _mm_prefetch(reinterpret_cast<const char*>(pr[i] + st * (kStep / 8) + pahead), _MM_HINT_T1);             \
            const auto idx = dot_gather_index<BITS>(pr[i], st);                                                        \
            F v = dot_step_values<BITS, SIGNED, kOffset>(kr[i], st, off);                                              \
            if constexpr (DOMAIN == 1) v = sub(v, bcast(zr[i] + gi));                                                  \
            _Pragma("GCC unroll 8")                                                                                    \
            for (int t = 0; t < M; ++t) {                                                                              \
              const F xg = gather(load_x(a.x + t * a.K + kStep * st), load_x(a.x + t * a.K + kStep * st + kStep / 2),  \
                                  idx);                                                                                \
              acc[i][t] = fma(v, xg, acc[i][t]);                                                                       \
              if constexpr (DOMAIN == 2) { /* groups of one step: z x into the sums */                                 \
                if (spg == 1) outz[i][t] = fma(bcast(zr[i] + gi), xg, outz[i][t]);                                     \
                else accx[i][t] = add(accx[i][t], xg);                                                                 \
              }                                                                                                        \
            }                                                                                                          \
          }                                                                                                            \
        }                                                                                                              \
        _Pragma("GCC unroll 8")                                                                                        \
        for (int i = 0; i < R; ++i)                                                                                    \
          _Pragma("GCC unroll 8")                                                                                      \
          for (int t = 0; t < M; ++t) {                                                                                \
            out[i][t] = fma(bcast(sr[i] + gi), acc[i][t], out[i][t]);                                                  \
            if constexpr (DOMAIN == 2)                                                                                 \
              if (spg != 1) outz[i][t] = fma(bcast(zr[i] + gi), accx[i][t], outz[i][t]);                               \
          }                                                                                                            \
      }                                                                                                                \
      /* compile-time indices only, or the accumulators live in memory: Note [accumulators in registers] */          \
      _Pragma("GCC unroll 8")                                                                                          \
      for (int i = 0; i < R; ++i)                                                                                      \
        _Pragma("GCC unroll 8")                                                                                        \
        for (int t = 0; t < M; ++t) {                                                                                  \
          const float y = hsum(add(out[i][t], outz[i][t]));                                                            \
          if (i < rows) a.out[t * a.N + rb + i] = y + (a.bias ? a.bias[rb + i] : 0.f);                                 \
        }                                                                                                              \
    }                                                                                                                  \
  }

// decode_rows for 2:4 with 8- or 4-bit codes and groups of whole pairs of blocks (8 columns), at the levels without
// vexpandps: a positions byte places the 4 entries of 2 blocks; no bit-stream reads.
template <int BITS>
void decode_rows_24(const NmArgs& a, int64_t r0, int64_t r1, float* dst, int64_t ldd) {
  const int64_t pairs = a.K / 8, ppg = a.g / 8;  // block pairs per row and per group
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* kr = a.kept + r * a.kept_bytes;
    const uint8_t* pr = a.positions + r * a.pos_bytes;
    float* d = dst + (r - r0) * ldd;
    std::fill(d, d + a.K, 0.f);
    GroupAffine ga;
    for (int64_t q = 0; q < pairs; ++q) {
      if (q % ppg == 0) ga = group_affine(a, r, q / ppg);
      const uint32_t pb = pr[q];
      float u[4];
      if constexpr (BITS == 8) {
        for (int j = 0; j < 4; ++j) u[j] = a.is_signed ? (float)(int8_t)kr[4 * q + j] : (float)kr[4 * q + j];
      } else {
        const uint8_t b0 = kr[2 * q], b1 = kr[2 * q + 1];
        u[0] = (float)(b0 & 15), u[1] = (float)(b0 >> 4), u[2] = (float)(b1 & 15), u[3] = (float)(b1 >> 4);
      }
      float* c = d + 8 * q;
      c[pb & 3] = ga(u[0]);
      c[(pb >> 2) & 3] = ga(u[1]);
      c[4 + ((pb >> 4) & 3)] = ga(u[2]);
      c[4 + (pb >> 6)] = ga(u[3]);
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace avx512 {
using F = __m512;
constexpr int64_t kStep = 32, kPrefetchEvery = 1, kPfRows = 2;
inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F bcast(const float* p) { return _mm512_set1_ps(*p); }  // a load with broadcast: no shuffle
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(F v) { return _mm512_reduce_add_ps(v); }
inline F load_x(const float* p) { return _mm512_loadu_ps(p); }

// Lane l's column within the step's 32: 4 (l / 2) + its 2-bit position (the step's positions are one 32-bit word).
inline __m512i gather_index(const uint8_t* positions_row, int64_t st) {
  const __m512i p = _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(positions_row + 4 * st));
  const __m512i shift = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  // (shifted & 3) | base in one vpternlogd: the base has its low two bits clear
  return _mm512_ternarylogic_epi32(_mm512_srlv_epi32(p, shift), _mm512_set1_epi32(3), base, 0xEA);
}
inline F gather(F x0, F x1, __m512i idx) { return _mm512_permutex2var_ps(x0, idx, x1); }

// 16 stored values u of step st (16 kept entries) as floats.
template <int BITS, bool SIGNED>
__attribute__((always_inline)) inline F step_values(const uint8_t* row, int64_t st) {
  if constexpr (BITS == 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * st));
    return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  } else {  // 4 bits: byte i holds fields 2 i (low nibble) and 2 i + 1
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * st));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  }
}

// Note [Int4 lanes out of storage order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Only the pairing of a kept weight with its activation matters to a dot product, not which lane holds the pair. So
// the int4 dot kernel puts entry e(l) = l / 2 + 8 (l % 2) in lane l: with the step's 8 bytes broadcast to every
// 64-bit lane (a load, no shuffle), even lanes see bytes 0-3 (entries 0-7) and odd lanes bytes 4-7 (entries 8-15),
// each its own nibble 4 (l / 2) bits up. One variable shift, one vpternlogd that masks the nibble and ORs in the
// exponent of 2^23 (the float 2^23 + u), and one subtraction of 2^23 - o give u + o: three vector ALU operations
// where widening bytes to lanes (a port-5 shuffle), converting and adding the offset took five. The gather index
// follows the same lane order. The prefill decode keeps storage order (vexpandps needs it).
template <int BITS>
__attribute__((always_inline)) inline __m512i dot_gather_index(const uint8_t* positions_row, int64_t st) {
  if constexpr (BITS == 4) {
    const __m512i p = _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(positions_row + 4 * st));
    // lane l holds entry e = l / 2 + 8 (l % 2): its position field sits 2 e bits up, its block starts at 4 (e / 2)
    const __m512i shift = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    const __m512i base = _mm512_setr_epi32(0, 16, 0, 16, 4, 20, 4, 20, 8, 24, 8, 24, 12, 28, 12, 28);
    return _mm512_ternarylogic_epi32(_mm512_srlv_epi32(p, shift), _mm512_set1_epi32(3), base, 0xEA);
  } else {
    return gather_index(positions_row, st);
  }
}

// u + o (o = `off`, added only when kOffset) for the dot kernel's lanes: storage order for 8-bit codes, Note [Int4
// lanes out of storage order] for 4-bit ones.
template <int BITS, bool SIGNED, bool kOffset>
__attribute__((always_inline)) inline F dot_step_values(const uint8_t* row, int64_t st, F off) {
  if constexpr (BITS == 4) {
    const __m512i q = _mm512_set1_epi64(*reinterpret_cast<const unaligned_i64*>(row + 8 * st));
    const __m512i shift = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    const __m512i bits = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(q, shift),
                                                   _mm512_set1_epi32(0x0F), _mm512_set1_epi32(0x4B000000), 0xEA);
    const F two23 = _mm512_set1_ps(8388608.f);
    return _mm512_sub_ps(_mm512_castsi512_ps(bits), kOffset ? _mm512_sub_ps(two23, off) : two23);
  } else {
    const F u = step_values<BITS, SIGNED>(row, st);
    return kOffset ? add(u, off) : u;
  }
}
TQK_NM_ROWS

// The 8 columns (of 2 blocks) a positions byte keeps, as a bit mask: entries 2 j and 2 j + 1 of block j sit at
// their 2-bit positions.
struct KeptColumns {
  uint8_t mask[256];
  KeptColumns() {
    for (int b = 0; b < 256; ++b)
      mask[b] = (uint8_t)((1u << (b & 3)) | (1u << ((b >> 2) & 3)) | (1u << (4 + ((b >> 4) & 3))) |
                          (1u << (4 + ((b >> 6) & 3))));
  }
};

// decode_rows for the dot kernels' cases: a step's 16 weights dequantized as the oracle does (Note [Kept codes as
// (u + o) s + z]) and expanded (vexpandps) onto the step's 32 columns under its kept-column mask: kept entries are
// stored in increasing column order, which is expand's order.
template <int BITS, bool SIGNED, int DOMAIN>
void decode_rows_expand(const NmArgs& a, int64_t r0, int64_t r1, float* dst, int64_t ldd) {
  static const KeptColumns kept_columns;
  const int64_t steps = a.K / kStep, spg = a.g / kStep;
  const F off = set1(DOMAIN == 2 ? a.qmin - a.mid : a.qmin);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* kr = a.kept + r * a.kept_bytes;
    const uint8_t* pr = a.positions + r * a.pos_bytes;
    const float* sr = a.scale + (r / a.bn) * a.G;
    const float* zr = a.zero ? a.zero + (r / a.bn) * a.G : nullptr;
    float* d = dst + (r - r0) * ldd;
    for (int64_t st = 0; st < steps; ++st) {
      const int64_t gi = st / spg;
      F v = add(step_values<BITS, SIGNED>(kr, st), off);
      if constexpr (DOMAIN == 1) v = sub(v, bcast(zr + gi));
      v = _mm512_mul_ps(v, bcast(sr + gi));
      if constexpr (DOMAIN == 2) v = add(v, bcast(zr + gi));
      const uint8_t* p = pr + 4 * st;
      const __mmask16 lo = (__mmask16)(kept_columns.mask[p[0]] | kept_columns.mask[p[1]] << 8);
      const __mmask16 hi = (__mmask16)(kept_columns.mask[p[2]] | kept_columns.mask[p[3]] << 8);
      _mm512_storeu_ps(d + kStep * st, _mm512_maskz_expand_ps(lo, v));
      _mm512_storeu_ps(d + kStep * st + 16, _mm512_maskz_expand_ps(hi, _mm512_shuffle_f32x4(v, v, 0xEE)));
    }
  }
}
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using F = __m256;
constexpr int64_t kStep = 16, kPrefetchEvery = 4, kPfRows = 2;  // a cache line of int8 codes per 4 steps
inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F bcast(const float* p) { return _mm256_broadcast_ss(p); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F load_x(const float* p) { return _mm256_loadu_ps(p); }

// Lane l's column within the step's 16 (the step's positions are one 16-bit word).
inline __m256i gather_index(const uint8_t* positions_row, int64_t st) {
  uint16_t p;
  __builtin_memcpy(&p, positions_row + 2 * st, 2);
  const __m256i shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i base = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
  return _mm256_add_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(p), shift), _mm256_set1_epi32(3)),
                          base);
}
// vpermps reads the low 3 bits of each index; bit 3 (column >= 8) picks x1, through blendv's sign bit
inline F gather(F x0, F x1, __m256i idx) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(x0, idx), _mm256_permutevar8x32_ps(x1, idx),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// 8 stored values u of step st (8 kept entries) as floats.
template <int BITS, bool SIGNED>
__attribute__((always_inline)) inline F step_values(const uint8_t* row, int64_t st) {
  if constexpr (BITS == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * st));
    return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  } else {
    uint32_t v;
    __builtin_memcpy(&v, row + 4 * st, 4);
    const __m128i b = _mm_cvtsi32_si128((int)v);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  }
}
template <int BITS>
inline __m256i dot_gather_index(const uint8_t* positions_row, int64_t st) { return gather_index(positions_row, st); }
template <int BITS, bool SIGNED, bool kOffset>
__attribute__((always_inline)) inline F dot_step_values(const uint8_t* row, int64_t st, F off) {
  const F u = step_values<BITS, SIGNED>(row, st);
  return kOffset ? add(u, off) : u;
}
TQK_NM_ROWS
}  // namespace avx2
#pragma GCC pop_options

#undef TQK_NM_ROWS

// The dot kernel for (ISA, bits, signed, tokens), or null where only the entry-at-a-time loop serves.
using RowsFn = void (*)(const NmArgs&, int64_t, int64_t);

template <int BITS, bool SIGNED, int DOMAIN, int M>
RowsFn pick_tokens(Isa isa) {
  return isa == Isa::kAvx512Vnni ? &avx512::rows_dot<BITS, SIGNED, DOMAIN, M>
                                 : &avx2::rows_dot<BITS, SIGNED, DOMAIN, M>;
}

template <int BITS, bool SIGNED, int DOMAIN>
RowsFn pick_m(Isa isa, int64_t M) {
  switch (M) {
    case 1: return pick_tokens<BITS, SIGNED, DOMAIN, 1>(isa);
    case 2: return pick_tokens<BITS, SIGNED, DOMAIN, 2>(isa);
    case 3: return pick_tokens<BITS, SIGNED, DOMAIN, 3>(isa);
    case 4: return pick_tokens<BITS, SIGNED, DOMAIN, 4>(isa);
    case 5: return pick_tokens<BITS, SIGNED, DOMAIN, 5>(isa);
    case 6: return pick_tokens<BITS, SIGNED, DOMAIN, 6>(isa);
    case 7: return pick_tokens<BITS, SIGNED, DOMAIN, 7>(isa);
    default: return pick_tokens<BITS, SIGNED, DOMAIN, 8>(isa);  // M <= kMaxDotTokens here
  }
}

template <int BITS, bool SIGNED>
RowsFn pick_domain(Isa isa, const NmArgs& a) {
  switch (a.domain) {
    case ZeroDomain::kNone: return pick_m<BITS, SIGNED, 0>(isa, a.M);
    case ZeroDomain::kInt: return pick_m<BITS, SIGNED, 1>(isa, a.M);
    default: return pick_m<BITS, SIGNED, 2>(isa, a.M);
  }
}

RowsFn dot_kernel(Isa isa, const NmArgs& a) {
  if (isa == Isa::kScalar || a.n != 2 || a.m != 4 || (a.bits != 4 && a.bits != 8)) return nullptr;
  const int64_t step = isa == Isa::kAvx512Vnni ? 32 : 16;  // columns per step
  if (a.K % step != 0 || a.g % step != 0) return nullptr;
  if (a.bits == 4) return pick_domain<4, false>(isa, a);  // below 8 bits the stored fields are offset binary
  return a.is_signed ? pick_domain<8, true>(isa, a) : pick_domain<8, false>(isa, a);
}

using DecodeFn = void (*)(const NmArgs&, int64_t, int64_t, float*, int64_t);

template <int BITS, bool SIGNED>
DecodeFn pick_decode_domain(const NmArgs& a) {
  switch (a.domain) {
    case ZeroDomain::kNone: return &avx512::decode_rows_expand<BITS, SIGNED, 0>;
    case ZeroDomain::kInt: return &avx512::decode_rows_expand<BITS, SIGNED, 1>;
    default: return &avx512::decode_rows_expand<BITS, SIGNED, 2>;
  }
}

// The prefill's row decoder: vector (AVX-512, the dot kernels' cases) or a weight at a time.
DecodeFn row_decoder(Isa isa, const NmArgs& a) {
  if (a.n != 2 || a.m != 4 || (a.bits != 4 && a.bits != 8) || a.K % 8 || a.g % 8) return &decode_rows;
  if (isa != Isa::kAvx512Vnni || a.K % 32 || a.g % 32) return a.bits == 4 ? &decode_rows_24<4> : &decode_rows_24<8>;
  if (a.bits == 4) return pick_decode_domain<4, false>(a);
  return a.is_signed ? pick_decode_domain<8, true>(a) : pick_decode_domain<8, false>(a);
}

ZeroDomain parse_domain(const std::string& d) {
  if (d == "none") return ZeroDomain::kNone;
  if (d == "int") return ZeroDomain::kInt;
  TORCH_CHECK(d == "float", kOp, ": zero_point_domain must be \"none\", \"int\" or \"float\", got \"", d, "\"");
  return ZeroDomain::kFloat;
}

const DescribeOp kDescribed(
    OpDescription(kOp)
        .at("avx512_vnni",
            "2:4 with int8 / int4 codes: 16 kept entries of a row per step, their activations gathered by one "
            "vpermt2ps on the decoded positions (Note [Gathering activations by position]), one FMA per entry "
            "and token, two rows interleaved up to 2-4 tokens, up to 8 tokens per pass; from 9 tokens rows "
            "decoded (vexpandps) for an fp32 GEMM; other patterns / widths, or groups not a multiple of 32: an "
            "entry at a time")
        .at("avx2", "the same, 8 kept entries per step gathered with two vpermps and a blend; groups a multiple of 16; "
                    "prefill rows decoded a positions byte (4 entries) at a time")
        .at("scalar", "an entry at a time (the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it)"));

}  // namespace

at::Tensor linear_nm_sparse_wo(const at::Tensor& x, const at::Tensor& kept, const at::Tensor& positions,
                               const at::Tensor& scale, const std::optional<at::Tensor>& zero_point, int64_t n,
                               int64_t m, int64_t bits, bool is_signed, c10::string_view zero_point_domain,
                               const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = kept.size(0);
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, kOp,
              ": activations must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(1 <= n && n < m && m <= 128, kOp, ": (n, m) = (", n, ", ", m, ") is not an N:M pattern");
  TORCH_CHECK(1 <= bits && bits <= 8, kOp, ": bits must be 1..8, got ", bits);
  TORCH_CHECK(K % m == 0, kOp, ": K = ", K, " is not a multiple of m = ", m, " (pad x to the stored in_features)");
  const int64_t E = K / m * n;
  int pbits = 1;
  while ((1 << pbits) < m) ++pbits;
  const int64_t kept_width = bits == 8 ? E : (E * bits + 7) / 8;
  TORCH_CHECK(kept.dim() == 2 && kept.element_size() == 1 && kept.size(1) == kept_width, kOp, ": kept must be (N, ",
              kept_width, ") bytes for K = ", K, ", ", n, ":", m, ", bits = ", bits, ", got ", kept.scalar_type(),
              " of shape ", kept.sizes());
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kByte && positions.size(0) == N &&
                  positions.size(1) == (E * pbits + 7) / 8,
              kOp, ": positions must be (N, ", (E * pbits + 7) / 8, ") uint8, got ", positions.scalar_type(),
              " of shape ", positions.sizes());
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) >= 1 && scale.size(1) >= 1 && N % scale.size(0) == 0 &&
                  K % scale.size(1) == 0 && (K / scale.size(1)) % m == 0,
              kOp, ": scale must be 2-d (N / bn, K / bk) dividing (N, K) = (", N, ", ", K,
              ") with groups of whole blocks of ", m, ", got ", scale.sizes());
  const ZeroDomain domain = parse_domain(std::string(zero_point_domain));
  TORCH_CHECK((domain == ZeroDomain::kNone) == !zero_point.has_value(), kOp, ": zero_point_domain \"",
              std::string(zero_point_domain), "\" ", zero_point.has_value() ? "takes no" : "needs a", " zero_point");
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  at::Tensor z;
  if (zero_point.has_value()) {
    TORCH_CHECK(zero_point->sizes() == scale.sizes(), kOp, ": zero_point must have the scale's shape ",
                scale.sizes(), ", got ", zero_point->sizes());
    z = zero_point->to(at::kFloat).contiguous();
  }
  const at::Tensor b = torchqkit_glue::float_bias(bias, N, kOp);
  const at::Tensor kr = torchqkit_glue::rows(kept), pr = torchqkit_glue::rows(positions);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, N}, xf.options());
  NmArgs a{};
  a.kept = reinterpret_cast<const uint8_t*>(kr.data_ptr());
  a.kept_bytes = kr.stride(0);
  a.positions = pr.data_ptr<uint8_t>();
  a.pos_bytes = pr.stride(0);
  a.scale = s.data_ptr<float>();
  a.zero = z.defined() ? z.data_ptr<float>() : nullptr;
  a.G = s.size(1);
  a.g = K / a.G;
  a.bn = N / s.size(0);
  a.n = (int)n;
  a.m = (int)m;
  a.bits = (int)bits;
  a.pbits = pbits;
  a.is_signed = is_signed;
  a.domain = domain;
  // stored fields below 8 bits are offset binary (u = code - qmin); 8-bit codes are stored as themselves
  a.qmin = bits < 8 && is_signed ? -(float)(1 << (bits - 1)) : 0.f;
  // the code midpoint of the FLOAT domain: (qmin + qmax + 1) / 2 of the codes (core/qdtype.py code_midpoint)
  a.mid = is_signed ? 0.f : (float)(1 << (bits - 1));
  a.x = xf.data_ptr<float>();
  a.K = K;
  a.N = N;
  a.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  a.out = out.data_ptr<float>();
  const Isa isa = selected_isa_for_ops();
  if (M > kMaxDotTokens && N > 0) {
    const DecodeFn decode = row_decoder(isa, a);
    prefill_dequantized(dequantized_by_sgemm(isa), xf, N, K, 16, a.bias, out, [&](int64_t r0, int64_t r1, float* dst) {
      decode(a, r0, std::min(r1, N), dst, K);
    });
    return out.reshape(torchqkit_glue::out_shape(x, N)).to(dt);
  }
  a.M = M;
  const RowsFn dot = M >= 1 ? dot_kernel(isa, a) : nullptr;
  const int64_t block = balanced_rows(N, 256, 16);
  at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    const int64_t r0 = b0 * block, r1 = std::min(N, b1 * block);
    dot ? dot(a, r0, r1) : rows_scalar(a, r0, r1);
  });
  return out.reshape(torchqkit_glue::out_shape(x, N)).to(dt);
}

}  // namespace torchqkit_cpu

TORCH_LIBRARY_IMPL(torchqkit, CPU, m) { m.impl("linear_nm_sparse_wo", &torchqkit_cpu::linear_nm_sparse_wo); }
