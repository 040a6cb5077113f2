// CPU backend of torchqkit::linear_ternarywo: ternary weights stored as bit planes (PackedIntxLayout(ternary=True),
// Note [Ternary bit planes] in torchqkit/layouts/packed_intx.py) times float activations, by table lookups: no
// weight is ever multiplied. The op (schema, fake, reference) is defined in torchqkit/kernels/ops/linear_ternarywo.py.
//
// Note [Ternary lookup tables]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// For every 4 consecutive activations x[4j .. 4j + 3] of a token, a table T_j of 16 sums is built once per call:
// T_j[s] = the sum of x[4j + i] over the bits i set in s. A row's 4 codes there are a "nonzero" nibble nz and a
// "negative" nibble ng (a negative bit only where the nonzero bit is set), and
//     sum_i w_i x[4j + i] = T_j[nz] - 2 T_j[ng]
// so 4 codes cost two table lookups and two additions. Vectorized, the lanes are rows: vpermps (AVX-512, 16 entries
// in one zmm) looks up 16 rows' nibbles at once, each from its own lane's index, and reads only the index's low 4
// bits. So one step takes 32 bits from each of 16 rows (16 codes: nonzero byte, negative byte, twice; read 16 steps at
// a time and transposed), and a shift puts each of the 8 nibbles into the lanes' low bits: per 16 codes of 16 rows 7
// shifts, 8 lookups and 8 additions, where the int2 kernel decodes and multiplies every code. A group's sum is
// scaled once per row (one FMA per group). AVX2 looks up 8 rows with two 8-entry vpermps and a blend (simd.h,
// Vec256::lookup). The tables take 16 floats per 4 activations (64 KiB per token at K = 4096, in L2). The vector
// kernels need whole steps of 16 codes in every group (K and the group size multiples of 16); other shapes, and the
// scalar level, run the same sums a row at a time. From kMaxDotTokens tokens on, rows are dequantized once for an
// fp32 GEMM (prefill_dequantized, sgemm_prefill.h).
#include <ATen/ATen.h>
#include "parallel.h"
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "aligned_vector.h"
#include "avx2_transpose.h"
#include "avx512_transpose.h"
#include "grouped_rows.h"
#include "kernel_descriptions.h"
#include "kernels.h"
#include "sgemm_prefill.h"
#include "simd.h"
#include "../common/aten_glue.h"

namespace torchqkit_cpu {
namespace {

constexpr const char* kOp = "torchqkit::linear_ternarywo";
constexpr int64_t kMaxDotTokens = 8;  // tokens per pass of the lookup kernels (their accumulators are registers)
constexpr int64_t kTable = 16;        // floats per table (4 activations)

struct TernaryArgs {
  const uint8_t* planes;  // (N, row_bytes): per 8 codes a nonzero byte, then a negative byte
  int64_t row_bytes;
  const float* scale;     // (N / bn, G) contiguous
  int64_t G, g, bn;
  const float* tables;    // M x (K / 4) tables of kTable floats (Note [Ternary lookup tables])
  int64_t M, K, N;
  float* out;             // (M, ldo)
  int64_t ldo;
  const float* bias;      // (N) or null
};

// T_j for every 4 activations of every token; activations past K count as 0.
void build_tables(const float* x, int64_t ldx, int64_t M, int64_t K, float* tables) {
  const int64_t J = (K + 3) / 4;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < J; ++j) {
      float v[4];
      for (int i = 0; i < 4; ++i) v[i] = 4 * j + i < K ? x[m * ldx + 4 * j + i] : 0.f;
      float* t = tables + (m * J + j) * kTable;
      for (int s = 0; s < 16; ++s)  // the same order of additions for every entry: x0, x1, x2, x3
        t[s] = (((s & 1 ? v[0] : 0.f) + (s & 2 ? v[1] : 0.f)) + (s & 4 ? v[2] : 0.f)) + (s & 8 ? v[3] : 0.f);
    }
}

// Rows [r0, r1) a row at a time: any K and group size (the scalar level, and shapes the vector kernels don't take).
void rows_scalar(const TernaryArgs& a, int64_t r0, int64_t r1) {
  const int64_t J = (a.K + 3) / 4;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.planes + r * a.row_bytes;
    const float* s = a.scale + (r / a.bn) * a.G;
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.tables + m * J * kTable;
      float y = 0.f;
      for (int64_t gi = 0; gi < a.G; ++gi) {
        float acc = 0.f;
        for (int64_t k = gi * a.g; k < (gi + 1) * a.g; ++k) {  // one code at a time: groups need not hold nibbles
          const int nz = (row[(k >> 3) * 2] >> (k & 7)) & 1, ng = (row[(k >> 3) * 2 + 1] >> (k & 7)) & 1;
          const float xk = x[(k >> 2) * kTable + (1 << (k & 3))];  // T_j[one bit] is that activation
          acc += (float)(nz - 2 * (nz & ng)) * xk;  // exact: x times -1, 0 or 1; branch-free (random codes)
        }
        y += acc * s[gi];
      }
      a.out[m * a.ldo + r] = y + (a.bias ? a.bias[r] : 0.f);
    }
  }
}

// The row-major dequantized weight rows [r0, r1) (for the prefill GEMM): code * its group's scale.
void decode_rows(const TernaryArgs& a, int64_t r0, int64_t r1, float* dst, int64_t ldd) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.planes + r * a.row_bytes;
    const float* s = a.scale + (r / a.bn) * a.G;
    float* d = dst + (r - r0) * ldd;
    for (int64_t gi = 0; gi < a.G; ++gi) {
      const float sv = s[gi];
      for (int64_t k = gi * a.g, end = (gi + 1) * a.g; k < end; ++k) {
        const int nz = (row[(k >> 3) * 2] >> (k & 7)) & 1, ng = (row[(k >> 3) * 2 + 1] >> (k & 7)) & 1;
        d[k] = (float)(nz - 2 * (nz & ng)) * sv;  // branch-free: random codes mispredict every other branch
      }
    }
  }
}

// The lookup kernel over vector traits V (simd.h): V::L rows per block, up to kMaxDotTokens tokens. The block's
// plane words (4 bytes = 16 codes, one step) and group scales are read V::L at a time from each row and transposed
// (load_words), so lane i of a step's vector is row i's word: with a vpgatherdd per step instead the kernel took 1.5x
// as long (Xeon, AVX-512, 1 thread, 4096^2 weight in cache).
#define TQK_TERNARY_ROWS                                                                                               \
  template <int M> /* tokens, a constant: the accumulators stay in registers */                                        \
  void rows_lookup(const TernaryArgs& a, int64_t r0, int64_t r1) {                                                     \
    constexpr int L = V::L;                                                                                            \
    const int64_t J = a.K / 4, steps = a.K / 16, spg = a.g / 16;                                                       \
    /* prefetch (into L2) what the next block of rows reads at the same column: Note [decode prefetch distance] */     \
    const int64_t ahead = L * a.row_bytes;                                                                             \
    /* and the next block's group scales (a block on where each row has its own: bn = 1); without it a decode over  */ \
    /* both threads took twice as long (4096^2, g32, Zen 5: 355 -> 170 us), one thread as long as with it          */ \
    const int64_t scales_ahead = a.bn == 1 ? L * a.G * (int64_t)sizeof(float) : 0;                                    \
    const uint8_t* rows_at[L];                                                                                         \
    const uint8_t* scales_at[L];                                                                                       \
    alignas(64) float res[L];                                                                                          \
    for (int64_t rb = r0; rb < r1; rb += L) {                                                                          \
      const int lanes = (int)std::min<int64_t>(L, r1 - rb);                                                            \
      for (int i = 0; i < lanes; ++i) {                                                                                \
        rows_at[i] = a.planes + (rb + i) * a.row_bytes;                                                                \
        scales_at[i] = reinterpret_cast<const uint8_t*>(a.scale + ((rb + i) / a.bn) * a.G);                            \
      }                                                                                                                \
      V::I words[L], scales[L];                                                                                        \
      V::F out[M], pos[M], neg[M];                                                                                     \
      for (int m = 0; m < M; ++m) out[m] = pos[m] = neg[m] = V::zero();                                                \
      for (int64_t st = 0; st < steps; ++st) {                                                                         \
        const int j = (int)(st % L);                                                                                   \
        if (j == 0) load_words(rows_at, lanes, st, std::min<int64_t>(L, steps - st), ahead, words);                    \
        const V::I w = words[j];                                                                                       \
        const V::I w4 = V::srli_i<4>(w), w8 = V::srli_i<8>(w), w12 = V::srli_i<12>(w);                                 \
        const V::I w16 = V::srli_i<16>(w), w20 = V::srli_i<20>(w), w24 = V::srli_i<24>(w), w28 = V::srli_i<28>(w);     \
        const float* t = a.tables + st * 4 * kTable; /* the step's 4 tables: activations 16 st .. 16 st + 15 */        \
        for (int m = 0; m < M; ++m, t += J * kTable) {                                                                 \
          const V::Lut16 t0 = V::lut16(t), t1 = V::lut16(t + 16), t2 = V::lut16(t + 32), t3 = V::lut16(t + 48);        \
          pos[m] = V::add(pos[m], V::add(V::add(V::lookup(t0, w), V::lookup(t1, w4)),                                  \
                                         V::add(V::lookup(t2, w16), V::lookup(t3, w20))));                             \
          neg[m] = V::add(neg[m], V::add(V::add(V::lookup(t0, w8), V::lookup(t1, w12)),                                \
                                         V::add(V::lookup(t2, w24), V::lookup(t3, w28))));                             \
        }                                                                                                              \
        if ((st + 1) % spg == 0) { /* the group ends: its sums times the rows' scales */                               \
          const int64_t gi = st / spg;                                                                                 \
          if (gi % L == 0) load_words(scales_at, lanes, gi, std::min<int64_t>(L, a.G - gi), scales_ahead, scales);     \
          const V::F s = cast_f(scales[gi % L]);                                                                       \
          for (int m = 0; m < M; ++m) {                                                                                \
            out[m] = V::fmadd(V::sub(pos[m], V::add(neg[m], neg[m])), s, out[m]);                                      \
            pos[m] = neg[m] = V::zero();                                                                               \
          }                                                                                                            \
        }                                                                                                              \
      }                                                                                                                \
      for (int m = 0; m < M; ++m) {                                                                                    \
        V::storeu(res, out[m]);                                                                                        \
        float* o = a.out + m * a.ldo + rb;                                                                             \
        for (int i = 0; i < lanes; ++i) o[i] = res[i] + (a.bias ? a.bias[rb + i] : 0.f);                               \
      }                                                                                                                \
    }                                                                                                                  \
  }                                                                                                                    \
  void rows_lookup_any(const TernaryArgs& a, int64_t r0, int64_t r1) {                                                 \
    switch (a.M) {                                                                                                     \
      case 1: return rows_lookup<1>(a, r0, r1);                                                                        \
      case 2: return rows_lookup<2>(a, r0, r1);                                                                        \
      case 3: return rows_lookup<3>(a, r0, r1);                                                                        \
      case 4: return rows_lookup<4>(a, r0, r1);                                                                        \
      case 5: return rows_lookup<5>(a, r0, r1);                                                                        \
      case 6: return rows_lookup<6>(a, r0, r1);                                                                        \
      case 7: return rows_lookup<7>(a, r0, r1);                                                                        \
      default: return rows_lookup<8>(a, r0, r1); /* M <= kMaxDotTokens here */                                         \
    }                                                                                                                  \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
using V = Vec512;
// out[s] lane i = 32-bit word w0 + s of at[i] (i < lanes; other lanes and words past n are 0).
inline void load_words(const uint8_t* const* at, int lanes, int64_t w0, int64_t n, int64_t ahead,
                       __m512i (&out)[16]) {
  const __mmask16 k = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
  for (int i = 0; i < 16; ++i) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(at[i] + 4 * w0 + ahead), _MM_HINT_T1);
    out[i] = i < lanes ? _mm512_maskz_loadu_epi32(k, at[i] + 4 * w0) : _mm512_setzero_si512();
  }
  transpose16(out);
}
inline __m512 cast_f(__m512i v) { return _mm512_castsi512_ps(v); }
TQK_TERNARY_ROWS
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using V = Vec256;
inline void load_words(const uint8_t* const* at, int lanes, int64_t w0, int64_t n, int64_t ahead,
                       __m256i (&out)[8]) {
  const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int i = 0; i < 8; ++i) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(at[i] + 4 * w0 + ahead), _MM_HINT_T1);
    out[i] = i < lanes ? _mm256_maskload_epi32(reinterpret_cast<const int*>(at[i] + 4 * w0), k)
                       : _mm256_setzero_si256();
  }
  transpose8(out);
}
inline __m256 cast_f(__m256i v) { return _mm256_castsi256_ps(v); }
TQK_TERNARY_ROWS

// decode_rows 8 codes at a time (groups of a multiple of 8 codes): each lane tests its bit of the two plane bytes,
// the negative one flips the scale's sign bit, the nonzero one keeps or clears the value.
void decode_rows(const TernaryArgs& a, int64_t r0, int64_t r1, float* dst, int64_t ldd) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128), sign = _mm256_set1_epi32(INT32_MIN);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.planes + r * a.row_bytes;
    const float* s = a.scale + (r / a.bn) * a.G;
    float* d = dst + (r - r0) * ldd;
    for (int64_t gi = 0; gi < a.G; ++gi) {
      const __m256i sv = _mm256_castps_si256(_mm256_set1_ps(s[gi]));
      for (int64_t k = gi * a.g, end = (gi + 1) * a.g; k < end; k += 8) {
        const __m256i nz = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(row[k / 4]), bit), bit);
        const __m256i ng = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(row[k / 4 + 1]), bit), bit);
        const __m256i v = _mm256_and_si256(nz, _mm256_xor_si256(sv, _mm256_and_si256(ng, sign)));
        _mm256_storeu_ps(d + k, _mm256_castsi256_ps(v));
      }
    }
  }
}
}  // namespace avx2
#pragma GCC pop_options

#undef TQK_TERNARY_ROWS

// The vector kernels take whole 16-code steps in every group.
bool lookup_kernels_take(const TernaryArgs& a) {
  return a.K % 16 == 0 && a.g % 16 == 0;
}

void run_rows(Isa isa, const TernaryArgs& a, int64_t r0, int64_t r1) {
  if (a.M >= 1 && lookup_kernels_take(a)) {
    if (isa == Isa::kAvx512Vnni) return avx512::rows_lookup_any(a, r0, r1);
    if (isa == Isa::kAvx2) return avx2::rows_lookup_any(a, r0, r1);
  }
  rows_scalar(a, r0, r1);
}

const DescribeOp kDescribed(
    OpDescription(kOp)
        .at("avx512_vnni",
            "AVX-512 table lookups (Note [Ternary lookup tables]): per 4 activations a 16-entry table of sums, one "
            "vpermps looks up 16 rows' nibbles, no multiplies by weights; up to 8 tokens per pass, then rows "
            "dequantized for an fp32 GEMM; K or a group size not a multiple of 16: the row-at-a-time loop")
        .at("avx2", "AVX2 table lookups, 8 rows per vpermps pair (the AVX-512 kernel's source); from 9 tokens rows "
                    "dequantized for an fp32 GEMM; K or a group size not a multiple of 16: the row-at-a-time loop")
        .at("scalar", "the same sums a row at a time (the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it)"));

}  // namespace

at::Tensor linear_ternarywo(const at::Tensor& x, const at::Tensor& planes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = planes.size(0);
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, kOp,
              ": activations must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(planes.dim() == 2 && planes.scalar_type() == at::kByte && planes.size(1) == 2 * ((K + 7) / 8), kOp,
              ": planes must be (N, 2 * ceil(K / 8)) = (N, ", 2 * ((K + 7) / 8), ") uint8 for K = ", K, ", got ",
              planes.scalar_type(), " of shape ", planes.sizes());
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) >= 1 && scale.size(1) >= 1 && N % scale.size(0) == 0 &&
                  K % scale.size(1) == 0,
              kOp, ": scale must be 2-d (N / bn, K / bk) dividing (N, K) = (", N, ", ", K, "), got ", scale.sizes());
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  const at::Tensor b = torchqkit_glue::float_bias(bias, N, kOp);
  const at::Tensor w = torchqkit_glue::rows(planes);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, N}, xf.options());
  TernaryArgs a{};
  a.planes = w.data_ptr<uint8_t>();
  a.row_bytes = w.stride(0);
  a.scale = s.data_ptr<float>();
  a.G = s.size(1);
  a.g = K / a.G;
  a.bn = N / s.size(0);
  a.K = K;
  a.N = N;
  a.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  const Isa isa = selected_isa_for_ops();
  if (M > kMaxDotTokens && N > 0) {
    const bool vector_decode = isa != Isa::kScalar && a.g % 8 == 0;
    prefill_dequantized(dequantized_by_sgemm(isa), xf, N, K, 16, a.bias, out, [&](int64_t r0, int64_t r1, float* dst) {
      vector_decode ? avx2::decode_rows(a, r0, std::min(r1, N), dst, K) : decode_rows(a, r0, std::min(r1, N), dst, K);
    });
    return out.reshape(torchqkit_glue::out_shape(x, N)).to(dt);
  }
  thread_local AlignedVector<float> tables;  // kept across calls (Note [scratch on cache lines])
  const size_t need = (size_t)std::max<int64_t>(1, M * ((K + 3) / 4) * kTable);
  if (tables.size() < need) tables.resize(need);
  build_tables(xf.data_ptr<float>(), K, M, K, tables.data());
  a.tables = tables.data();
  a.M = M;
  a.out = out.data_ptr<float>();
  a.ldo = N;
  const int64_t block = balanced_rows(N, 256, 16);
  at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    run_rows(isa, a, b0 * block, std::min(N, b1 * block));
  });
  return out.reshape(torchqkit_glue::out_shape(x, N)).to(dt);
}

// A stack of experts (E, N, ...) of these bit planes: rows [offs[g - 1], offs[g]) of x through expert g (Note [Grouped
// linear in C++], grouped_rows.h).
at::Tensor grouped_linear_ternarywo(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& planes,
                                   const at::Tensor& scale) {
  constexpr const char* op = "torchqkit::grouped_linear_ternarywo";
  TORCH_CHECK(planes.dim() >= 3 && scale.dim() >= 2 && planes.size(0) == scale.size(0), op,
              ": planes (E, N, ...) and scale (E, N, ...) of the same E experts, got ", planes.sizes(), " and ",
              scale.sizes());
  return grouped_rows(op, x, offs, planes.size(0), planes.size(1), [&](const at::Tensor& rows, int64_t g) {
    return linear_ternarywo(rows, planes.select(0, g), scale.select(0, g), {});
  });
}

namespace {
const DescribeOp kGroupedTernaryDescribed(
    grouped_description("torchqkit::grouped_linear_ternarywo", "torchqkit::linear_ternarywo"));
}  // namespace

}  // namespace torchqkit_cpu

TORCH_LIBRARY_IMPL(torchqkit, CPU, m) {
  m.impl("linear_ternarywo", &torchqkit_cpu::linear_ternarywo);
  m.impl("grouped_linear_ternarywo", &torchqkit_cpu::grouped_linear_ternarywo);
}
