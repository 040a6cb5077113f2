// Attention over the filled positions of a static KV cache (torchqkit::sdpa_over_filled_cache) for x86:
// scalar, AVX2 + FMA, AVX-512. No torch header here (see kernels.h); the glue is decode_attention_ops.cpp.
//
// Note [Filled-cache attention kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decode step attends one query row per head over a cache of S positions of which only the first n are
// filled; the mask hides the rest. The glue finds n from the mask (last_visible_count: a backwards scan of the
// mask row, 8 bytes or 16 floats per step) and this kernel reads K and V rows [0, n) only. Per (batch, kv head)
// the G = Hq / Hkv query heads of the group and their Lq rows are computed together, in tiles of up to 4 rows,
// so each K and V row is loaded once per tile (SmolLM2: 3 query heads per kv head, one row each at decode).
// Three passes over the tile's n scores (n is small at decode, and the scores stay in L1): masked, scaled
// scores and their max; e^(s - max) with a vectorized exp and the sum; the weighted sum of V rows. The math is
// sdpa's: softmax(q k^T * scale + mask) v, a bool mask hiding with -inf, rows that see nothing giving 0.
// The whole call is a few microseconds for SmolLM2 at n ~ 50, where the Python reference it replaces spent
// ~40-55 us on finding n with numpy, slicing and dispatching to sdpa.
#include "decode_attention.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace torchqkit_cpu {
namespace {

// Per-thread scores of one tile (4 rows x n), reused across calls: no allocation per call once grown.
float* tile_scratch(int64_t n) {
  thread_local AlignedVector<float> buf;
  if ((int64_t)buf.size() < 4 * n) buf.resize(4 * n);
  return buf.data();
}

// The largest j + 1 in (lo, S] whose mask entry is visible, or lo: from the end, 8 bytes / 16 floats per step.
int64_t scan_bool(const uint8_t* row, int64_t lo, int64_t S) {
  int64_t j = S;
  while (j - 8 >= lo) {
    uint64_t w;
    std::memcpy(&w, row + j - 8, 8);
    if (w) break;
    j -= 8;
  }
  for (; j > lo; --j)
    if (row[j - 1]) return j;
  return lo;
}

int64_t scan_add(const float* row, int64_t lo, int64_t S, float hidden) {
  int64_t j = S;
  while (j - 16 >= lo) {
    bool any = false;
    for (int i = 0; i < 16; ++i) any |= row[j - 16 + i] > hidden;
    if (any) break;
    j -= 16;
  }
  for (; j > lo; --j)
    if (row[j - 1] > hidden) return j;
  return lo;
}

// ================================================================================================
// Scalar: any x86-64 CPU
// ================================================================================================
namespace scalar {

void attend_items(const FilledAttentionArgs& p, int64_t item0, int64_t item1, float* s) {
  const int64_t G = p.Hq / p.Hkv, n = p.n;
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t b = item / p.Hkv, kvh = item % p.Hkv;
    const float* k = p.k + b * p.k_sb + kvh * p.k_sh;
    const float* v = p.v + b * p.v_sb + kvh * p.v_sh;
    for (int64_t row = 0; row < G * p.Lq; ++row) {
      const int64_t h = kvh * G + row / p.Lq, l = row % p.Lq;
      const float* q = p.q + b * p.q_sb + h * p.q_sh + l * p.q_sl;
      const int64_t moff = b * p.m_sb + h * p.m_sh + l * p.m_sl;
      float* out = p.out + b * p.o_sb + h * p.o_sh + l * p.o_sl;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        float x = 0.f;
        for (int64_t d = 0; d < p.D; ++d) x += q[d] * k[j * p.k_ss + d];
        x *= p.scale;
        if (p.mask_bool) x = p.mask_bool[moff + j] ? x : -std::numeric_limits<float>::infinity();
        else x += p.mask_add[moff + j];
        s[j] = x;
        mx = std::max(mx, x);
      }
      for (int64_t d = 0; d < p.Dv; ++d) out[d] = 0.f;
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // sees nothing: 0, as sdpa
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - mx);
        total += s[j];
      }
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < p.Dv; ++d) out[d] += s[j] * v[j * p.v_ss + d];
      for (int64_t d = 0; d < p.Dv; ++d) out[d] /= total;
    }
  }
}

}  // namespace scalar

// ================================================================================================
// AVX-512 (F/BW/VL/DQ): 16 lanes
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
using V = Vec512;
#include "decode_attention_isa.h"
}  // namespace avx512
#pragma GCC pop_options

// ================================================================================================
// AVX2 + FMA: 8 lanes
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using V = Vec256;
#include "decode_attention_isa.h"
}  // namespace avx2
#pragma GCC pop_options

}  // namespace

int64_t last_visible_count(const FilledAttentionArgs& p, int64_t S, float hidden) {
  // A broadcast dimension (stride 0) repeats the same row: scan it once.
  const int64_t nb = p.m_sb ? p.B : 1, nh = p.m_sh ? p.Hq : 1, nl = p.m_sl ? p.Lq : 1;
  int64_t count = 0;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t l = 0; l < nl; ++l) {
        const int64_t off = b * p.m_sb + h * p.m_sh + l * p.m_sl;
        count = p.mask_bool ? scan_bool(p.mask_bool + off, count, S) : scan_add(p.mask_add + off, count, S, hidden);
        if (count == S) return S;
      }
  return count;
}

void filled_attention(Isa isa, const FilledAttentionArgs& p, int64_t item0, int64_t item1) {
  float* scratch = tile_scratch(std::max<int64_t>(p.n, 1));
  switch (base_isa(isa)) {  // AVX512-BF16 -> AVX-512, AVX-VNNI -> AVX2
    case Isa::kAvx512Vnni: return avx512::attend_items(p, item0, item1, scratch);
    case Isa::kAvx2: return avx2::attend_items(p, item0, item1, scratch);
    default: return scalar::attend_items(p, item0, item1, scratch);
  }
}

}  // namespace torchqkit_cpu
