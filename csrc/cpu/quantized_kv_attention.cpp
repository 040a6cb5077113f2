// Attention over a quantized KV cache (torchqkit::sdpa_quantized_kv_cache) for x86: scalar, AVX2 + FMA, AVX-512.
// No torch header here (see kernels.h); the glue is quantized_kv_attention_ops.cpp.
//
// Note [Quantized KV attention kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The cache keeps K and V as codes plus per-group scales (quantized_kv_attention.h has the layout), and the
// newest positions as float rows. A work unit is up to kQueryChunk query rows of one (batch, kv head) (the G query
// heads of a GQA group x Lq rows share its K / V rows). It walks the positions kKeyBlock at a time: the block's K
// and V rows are decoded (codes times scales, plus zeros) into kKeyBlock x D tiles (a few KB, in L1; never a
// dequantized copy of the cache). Each query row then gets its kKeyBlock scores: from kTransposeRows rows per unit
// (prefill) as vector FMAs across the keys of the K tile transposed (no horizontal sums); with fewer (decode) as one
// dot per key, whose 16 partial-sum vectors a shuffle tree folds into one at AVX-512 (plain lane loops at 256 bits,
// where GCC splits 16-lane shuffles into slow lane moves: kLaneShuffles). An online softmax (running maximum and
// sum per row, the accumulator rescaled when the maximum grows) adds the weighted V rows. The math is sdpa's:
// softmax(q k^T * scale + mask) v with -inf for hidden positions and 0 for rows that see nothing; without a mask
// the Lq queries are the last Lq positions, causal, so a chunk stops at its last query's position (half the work
// of a prefill). e^x is a polynomial the compiler vectorizes (exp_nonpositive). Decode (Lq = 1) is one unit per kv
// head, cut into splits over positions when that is too few for the threads (Note [Quantized KV attention split over
// positions]); a prefill has many, split across threads. The source is plain loops and GCC vector extensions, compiled
// once per ISA region below at that region's width. Float8 codes are decoded through 256-entry tables built from
// the format's bits.
#include "quantized_kv_attention.h"

// The key-block vectors (GCC vector extensions, 64 bytes) are returned by value from inlined helpers only, so
// GCC's note (at the end of the file) that this changes the ABI in the regions without AVX-512 does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace torchqkit_cpu {
namespace {

// float8 e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, 0x7f / 0xff are NaN.
// float8 e5m2: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (exponent 31: inf / NaN).
std::array<float, 256> float8_table(int exp_bits, int man_bits, bool fn) {
  std::array<float, 256> t{};
  const int bias = (1 << (exp_bits - 1)) - 1, emax = (1 << exp_bits) - 1, mmax = (1 << man_bits) - 1;
  for (int c = 0; c < 256; ++c) {
    const int sign = c >> 7, e = (c >> man_bits) & emax, m = c & mmax;
    float v;
    if (e == 0) v = std::ldexp((float)m / (float)(1 << man_bits), 1 - bias);
    else if (e == emax && (!fn || m == mmax)) v = (fn || m) ? std::numeric_limits<float>::quiet_NaN()
                                                            : std::numeric_limits<float>::infinity();
    else v = std::ldexp(1.f + (float)m / (float)(1 << man_bits), e - bias);
    t[c] = sign ? -v : v;
  }
  return t;
}

const std::array<float, 256> kFloat8E4M3Table = float8_table(4, 3, true);
const std::array<float, 256> kFloat8E5M2Table = float8_table(5, 2, false);

// float16 bits to float: the 15 low bits moved into a float's exponent / mantissa place and scaled by 2^112 (the
// exponent bias difference, 127 - 15) serve normal and subnormal halves alike; infinities and NaNs keep their
// all-ones exponent.
inline float half_to_float(uint16_t h) {
  const uint32_t em = h & 0x7fffu;
  uint32_t bits = em << 13;
  float f;
  std::memcpy(&f, &bits, 4);
  f *= 5.192296858534828e+33f;  // 2^112
  std::memcpy(&bits, &f, 4);
  if (em >= 0x7c00u) bits = 0x7f800000u | ((em & 0x3ffu) << 13);
  bits |= (uint32_t)(h & 0x8000u) << 16;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Per-thread scratch, reused across calls: no allocation per call once grown.
float* scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < floats) buf.resize(floats);
  return buf.data();
}

namespace scalar {
constexpr bool kLaneShuffles = false;
#include "quantized_kv_attention_isa.h"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
constexpr bool kLaneShuffles = true;  // one vpermt2ps / vpermps per 16-lane shuffle
#include "quantized_kv_attention_isa.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr bool kLaneShuffles = false;  // 16-lane shuffles of two ymm halves are slow: plain lane loops
#include "quantized_kv_attention_isa.h"
}  // namespace avx2
#pragma GCC pop_options

}  // namespace

void quantized_kv_attention(Isa isa, const QuantizedAttentionArgs& p, int64_t unit0, int64_t unit1) {
  const int64_t D = p.D, Dv = p.Dv;
  float* s = scratch(2 * D * kKeyBlock + kKeyBlock * Dv + kQueryChunk * (Dv + 2) + 2 * (D + Dv));
  switch (base_isa(isa)) {  // AVX512-BF16 -> AVX-512, AVX-VNNI -> AVX2
    case Isa::kAvx512Vnni: return avx512::attend_units(p, unit0, unit1, s);
    case Isa::kAvx2: return avx2::attend_units(p, unit0, unit1, s);
    default: return scalar::attend_units(p, unit0, unit1, s);
  }
}

// Note [Quantized KV attention split over positions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decode step has one work unit per kv head (SmolLM2: 3), too few to keep the threads equally busy (two threads
// take two units and one). So when the units are fewer than the threads times kSplitUnitsPerThread and the cache is
// long, the glue cuts each unit's positions into S splits of whole key blocks (S chosen so the units divide evenly
// over the threads; at least kSplitMinPositions each). Each split runs the same online softmax over its positions
// and leaves its rows unnormalized with their running maximum m_s and sum l_s; then each row's output is
// sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s with m = max_s m_s (a split that saw nothing has m_s = -inf and
// weighs 0; a row that saw nothing anywhere is 0, as without splits). The sums are the unsplit ones regrouped, so the
// result differs from one pass by float32 rounding only.
void combine_splits(const QuantizedAttentionArgs& p, int64_t item0, int64_t item1) {
  const int64_t G = p.Hq / p.Hkv, R = G * p.Lq, chunks = query_chunks(p), S = p.splits, Dv = p.Dv;
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t b = item / p.Hkv, kvh = item % p.Hkv;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const float* first = p.partial + (item * chunks + chunk) * S * partial_floats(p);
      const int64_t r0 = chunk * kQueryChunk, rb = std::min(kQueryChunk, R - r0);
      for (int64_t i = 0; i < rb; ++i) {
        const int64_t r = r0 + i, h = kvh * G + r / p.Lq, l = r % p.Lq;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) m = std::max(m, first[s * partial_floats(p) + i * (Dv + 2)]);
        float* o = p.out + b * p.o_sb + h * p.o_sh + l * p.o_sl;
        for (int64_t d = 0; d < Dv; ++d) o[d] = 0.f;
        float total = 0.f;
        if (m != -std::numeric_limits<float>::infinity()) {
          for (int64_t s = 0; s < S; ++s) {
            const float* row = first + s * partial_floats(p) + i * (Dv + 2);
            if (row[0] == -std::numeric_limits<float>::infinity()) continue;
            const float w = std::exp(row[0] - m);
            total += w * row[1];
            for (int64_t d = 0; d < Dv; ++d) o[d] += w * row[2 + d];
          }
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
      }
    }
  }
}

}  // namespace torchqkit_cpu
