// CPU kernel of torchqkit::fake_quantize_activation: an activation quantized to float8 (per tensor, per token or
// static), MXFP8 or NVFP4 and dequantized again, in one pass over the rows.
//
// The op (schema, fake, reference) is defined in torchqkit/kernels/ops/fake_quantize_activation.py; registration.cpp
// registers this function.
//
// Note [Fake-quantized activations in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The float8 / MXFP8 / NVFP4 activation configs run a weight-only kernel on the activation quantized and dequantized
// by its ActivationQuantSpec (Note [Activations fake-quantized before a weight-only kernel], layouts/routes.py). The
// spec's torch ops (choose_qparams_affine, quantize_affine, dequantize_affine, with their checks) cost 0.1-0.25 ms
// of CPU for one token, as much as the 4096 x 4096 weight-only kernel itself, and NVFP4's codebook rounding 20 ms
// for 256 tokens. The work is a few passes over M x K values: this kernel computes the scales with the reference's
// float32 arithmetic in the same order and rounds the values in vectors (RowLoops), bit for bit:
//   float8 (a scale per token, per tensor or static): amax = max |x| (per tensor: over the finite values); s =
//     amax / max_level floored at float32's smallest normal, 1 for amax = 0, capped so max_level * s stays within
//     the input dtype's largest value; y = float8(clamp(x / s, -max, max)) * s, float8 rounded to nearest even by
//     c10's conversion (the one torch's .to() uses).
//   MXFP8 (a scale per token and 32 features): s = 2^clamp(floor(log2(amax)) - emax_elem, -127, 127) by frexp, 1
//     for amax = 0; y as float8.
//   NVFP4 (per token and 16 features): raw = amax / 6 per block; q = the largest power of two with top * 2^q <= 448
//     (top = the largest raw of the tensor, its finite values), in [-119, 127]; E = e4m3(min(raw * 2^q, 448)), one
//     e4m3 code down where 6 * E * 2^-q passes the input dtype's largest value, at least 2^-9; s = E * 2^-q;
//     y = the nearest e2m1 level of x / s (ties towards zero, clamped to +-6) times s.
// A row holding NaN / Inf comes out all NaN and takes no part in a per-tensor scale (Note [Non-finite activation
// rows]). With group ends `offs` (a stack of experts), a per-tensor or NVFP4 tensor-wide scale is taken over each
// group's rows, as each expert's own linear takes it; rows past the last end are copied unchanged.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_descriptions.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace torchqkit_cpu {
namespace {

constexpr const char* kOp = "torchqkit::fake_quantize_activation";

enum class Fmt { kE4M3FN, kE5M2, kE4M3FNUZ, kE5M2FNUZ, kNVFP4 };

struct Format {
  Fmt fmt;
  float max_level;  // the largest |code value|
  int emax_elem;    // floor(log2(max_level)): MXFP8's scale exponent offset
};

Format parse_format(const std::string& name) {
  if (name == "float8_e4m3fn") return {Fmt::kE4M3FN, 448.f, 8};
  if (name == "float8_e5m2") return {Fmt::kE5M2, 57344.f, 15};
  if (name == "float8_e4m3fnuz") return {Fmt::kE4M3FNUZ, 240.f, 7};
  if (name == "float8_e5m2fnuz") return {Fmt::kE5M2FNUZ, 57344.f, 15};
  if (name == "fp4_e2m1") return {Fmt::kNVFP4, 6.f, 2};
  TORCH_CHECK_VALUE(false, kOp, ": activation format '", name,
                    "' is not one of float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, fp4_e2m1");
}

// x / s clamped to the format's range and rounded to a float8 value (as float).
inline float float8_value(Fmt fmt, float v, float fmax) {
  v = std::min(std::max(v, -fmax), fmax);
  switch (fmt) {
    case Fmt::kE4M3FN: return static_cast<float>(c10::Float8_e4m3fn(v));
    case Fmt::kE5M2: return static_cast<float>(c10::Float8_e5m2(v));
    case Fmt::kE4M3FNUZ: return static_cast<float>(c10::Float8_e4m3fnuz(v));
    default: return static_cast<float>(c10::Float8_e5m2fnuz(v));
  }
}

// The nearest e2m1 level of v, a tie going to the level nearer zero; +0 for the zero level.
inline float e2m1_level(float v) {
  const float a = std::fabs(v);
  float level;
  if (a <= 0.25f) return 0.f;
  else if (a <= 0.75f) level = 0.5f;
  else if (a <= 1.25f) level = 1.f;
  else if (a <= 1.75f) level = 1.5f;
  else if (a <= 2.5f) level = 2.f;
  else if (a <= 3.5f) level = 3.f;
  else if (a <= 5.f) level = 4.f;
  else level = 6.f;  // also |v| > 6: clamped
  return v < 0.f ? -level : level;
}

// float32's smallest normal: the dynamic scales' floor (choose_qparams_affine's eps for float32 scales).
constexpr float kFloatTiny = std::numeric_limits<float>::min();
constexpr double kFloatEps = 1.1920928955078125e-07;
constexpr float kE4M3Max = 448.f, kE4M3Tiny = 0.001953125f;  // 2^-9: e4m3's smallest subnormal
constexpr int kQMin = -119, kQMax = 127;

// A float8 scale per token or tensor from amax (core's absmax branch of choose_qparams_affine).
inline float float8_scale(float amax, float max_level, float bound) {
  float s = amax / max_level;
  s = amax > 0.f ? std::max(s, kFloatTiny) : 1.f;
  return s > bound ? bound : s;
}

// 2^e as float32, exact for e in [-149, 127] (a normal's bits, else ldexp).
inline float pow2(int e) {
  if (e < -126) return std::ldexp(1.f, e);
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// MXFP8's E8M0 block scale (core's _power_of_two_scale): floor(log2(amax)) is frexp's exponent less one, read from
// the bits for a normal amax.
inline float power_of_two_scale(float amax, int emax_elem) {
  if (!(amax > 0.f)) return 1.f;
  uint32_t bits;
  std::memcpy(&bits, &amax, 4);
  int floor_log2 = static_cast<int>(bits >> 23) - 127;
  if ((bits >> 23) == 0) {  // subnormal
    int p;
    std::frexp(amax, &p);
    floor_log2 = p - 1;
  }
  return pow2(std::min(std::max(floor_log2 - emax_elem, -127), 127));
}

// NVFP4's power of two q: the largest with top * 2^q <= 448 (core's _pow2_exponent_below), clamped.
int nvfp4_exponent(float top) {
  if (!(top > 0.f)) top = 1.f;
  int p;
  std::frexp(kE4M3Max / top, &p);
  int q = p - 1;
  if (std::ldexp(top, q) > kE4M3Max) --q;
  if (std::ldexp(top, q + 1) <= kE4M3Max) ++q;
  return std::min(std::max(q, kQMin), kQMax);
}

// NVFP4's block scale E * 2^-q for a block of largest |x| amax (core's _float8_block_scale); up = 2^q and down =
// 2^-q, exact for q in [-119, 127], so the products are ldexp's.
inline float nvfp4_block_scale(float amax, float up, float down, float limit) {
  const float raw = amax / 6.f;
  uint8_t code = c10::Float8_e4m3fn(std::min(raw * up, kE4M3Max)).x;
  if (static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits())) * down * 6.f > limit) --code;
  const float e = std::max(static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits())), kE4M3Tiny);
  return e * down;
}

// Float8 parameters of the vector kernels: codes' largest value, smallest normal exponent (biased, as float32 stores
// it) and mantissa bits, and whether -0 has no code (fnuz: it reads back +0).
struct Float8Bits {
  float fmax;
  int emin_biased, mbits;
  bool fnuz;
};

Float8Bits float8_bits(const Format& f) {
  switch (f.fmt) {
    case Fmt::kE4M3FN: return {448.f, 127 - 6, 3, false};
    case Fmt::kE5M2: return {57344.f, 127 - 14, 2, false};
    case Fmt::kE4M3FNUZ: return {240.f, 127 - 7, 3, true};
    default: return {57344.f, 127 - 15, 2, true};
  }
}

// One ISA's loops over n float32 values (any n: whole vectors, then the scalar functions above for the tail; both
// exact, so they agree bit for bit):
//   amax(x, n)                 largest |x|
//   float8(x, y, n, s, f, b)   y = float8 value of clamp(x / s) times s
//   nvfp4(x, y, n, s)          y = e2m1 level of x / s times s
// A float8 value: the quantum 2^(max(e, emin) - mbits) of v's binade, v rounded to a multiple of it (ties to even,
// as c10's conversion rounds), both by exponent arithmetic (v * 2^-quantum exact). An e2m1 level: the quantum 0.5
// below 2, 1 below 4, 2 above; level = ceil(|v| / quantum - 0.5) * quantum, a tie going down.
struct RowLoops {
  uint32_t (*max_abs_bits)(const float* x, int64_t n);  // the largest |x|'s bits: >= Inf's for a non-finite row
  float (*amax)(const float* x, int64_t n);
  void (*float8)(const float* x, float* y, int64_t n, float s, const Format& f, const Float8Bits& b);
  void (*nvfp4)(const float* x, float* y, int64_t n, float s);
};

namespace scalar {
uint32_t max_abs_bits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t k = 0; k < n; ++k) {
    uint32_t b;
    std::memcpy(&b, x + k, 4);
    m = std::max(m, b & 0x7fffffffu);
  }
  return m;
}
float amax(const float* x, int64_t n) {
  float m = 0.f;
  for (int64_t k = 0; k < n; ++k) m = std::max(m, std::fabs(x[k]));
  return m;
}
void float8(const float* x, float* y, int64_t n, float s, const Format& f, const Float8Bits&) {
  for (int64_t k = 0; k < n; ++k) y[k] = float8_value(f.fmt, x[k] / s, f.max_level) * s;
}
void nvfp4(const float* x, float* y, int64_t n, float s) {
  for (int64_t k = 0; k < n; ++k) y[k] = e2m1_level(x[k] / s) * s;
}
}  // namespace scalar

#define TQK_FQ_LOOPS                                                                                                  \
  uint32_t max_abs_bits(const float* x, int64_t n) {                                                                  \
    const int64_t nv = n / V::L * V::L;                                                                               \
    V::I m = V::zero_i();                                                                                             \
    for (int64_t k = 0; k < nv; k += V::L) m = max_i(m, as_i(V::abs(V::loadu(x + k)))); /* bits of |x| order as |x| */ \
    return std::max(nv ? reduce_max_i(m) : 0u, scalar::max_abs_bits(x + nv, n - nv));                                \
  }                                                                                                                   \
  float amax(const float* x, int64_t n) {                                                                             \
    const int64_t nv = n / V::L * V::L;                                                                               \
    V::F m = V::zero();                                                                                               \
    for (int64_t k = 0; k < nv; k += V::L) m = V::max(m, V::abs(V::loadu(x + k)));                                    \
    return std::max(nv ? V::reduce_max(m) : 0.f, scalar::amax(x + nv, n - nv));                                       \
  }                                                                                                                   \
  void float8(const float* x, float* y, int64_t n, float s, const Format& f, const Float8Bits& b) {                   \
    const int64_t nv = n / V::L * V::L;                                                                               \
    const V::F sv = V::set1(s), hi = V::set1(b.fmax), lo = V::set1(-b.fmax);                                          \
    const V::I emin = V::set1_i(b.emin_biased), mb = V::set1_i(b.mbits), inv_base = V::set1_i(254 + b.mbits);        \
    for (int64_t k = 0; k < nv; k += V::L) {                                                                          \
      const V::F v = V::min(V::max(V::div(V::loadu(x + k), sv), lo), hi);                                             \
      const V::I e = max_i(V::srli_i<23>(as_i(V::abs(v))), emin);                                                     \
      const V::F quantum = as_f(V::slli_i<23>(V::sub_i(e, mb)));                                                      \
      const V::F inverse = as_f(V::slli_i<23>(V::sub_i(inv_base, e)));                                                \
      V::F r = V::mul(V::round_even(V::mul(v, inverse)), quantum);                                                    \
      if (b.fnuz) r = V::add(r, V::zero()); /* -0 + +0 = +0: fnuz has no -0 */                                        \
      V::storeu(y + k, V::mul(r, sv));                                                                                \
    }                                                                                                                 \
    scalar::float8(x + nv, y + nv, n - nv, s, f, b);                                                                  \
  }                                                                                                                   \
  void nvfp4(const float* x, float* y, int64_t n, float s) {                                                          \
    const int64_t nv = n / V::L * V::L;                                                                               \
    const V::F sv = V::set1(s), six = V::set1(6.f), half = V::set1(0.5f);                                             \
    const V::I e_lo = V::set1_i(127), e_hi = V::set1_i(129), one = V::set1_i(1), inv_base = V::set1_i(255);          \
    for (int64_t k = 0; k < nv; k += V::L) {                                                                          \
      const V::F v = V::div(V::loadu(x + k), sv);                                                                     \
      const V::F a = V::min(V::abs(v), six);                                                                          \
      const V::I e = min_i(max_i(V::srli_i<23>(as_i(a)), e_lo), e_hi);                                                \
      const V::F quantum = as_f(V::slli_i<23>(V::sub_i(e, one)));                                                     \
      const V::F inverse = as_f(V::slli_i<23>(V::sub_i(inv_base, e)));                                               \
      /* max(-0, +0) is its second operand, +0: the zero level is +0 whatever v's sign */                             \
      const V::F level = V::mul(V::max(ceil(V::sub(V::mul(a, inverse), half)), V::zero()), quantum);                 \
      V::storeu(y + k, V::mul(sign_unless_zero(level, v), sv));                                                       \
    }                                                                                                                 \
    scalar::nvfp4(x + nv, y + nv, n - nv, s);                                                                         \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
using V = Vec512;
inline __m512i as_i(__m512 v) { return _mm512_castps_si512(v); }
inline __m512 as_f(__m512i v) { return _mm512_castsi512_ps(v); }
inline __m512i max_i(__m512i a, __m512i b) { return _mm512_max_epi32(a, b); }
inline __m512i min_i(__m512i a, __m512i b) { return _mm512_min_epi32(a, b); }
inline uint32_t reduce_max_i(__m512i v) { return static_cast<uint32_t>(_mm512_reduce_max_epi32(v)); }
inline __m512 ceil(__m512 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC); }
// level (>= 0) with v's sign where level > 0
inline __m512 sign_unless_zero(__m512 level, __m512 v) {
  const __mmask16 nonzero = _mm512_cmp_ps_mask(level, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_mask_or_ps(level, nonzero, level, _mm512_and_ps(v, _mm512_set1_ps(-0.f)));
}
TQK_FQ_LOOPS
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using V = Vec256;
inline __m256i as_i(__m256 v) { return _mm256_castps_si256(v); }
inline __m256 as_f(__m256i v) { return _mm256_castsi256_ps(v); }
inline __m256i max_i(__m256i a, __m256i b) { return _mm256_max_epi32(a, b); }
inline __m256i min_i(__m256i a, __m256i b) { return _mm256_min_epi32(a, b); }
inline uint32_t reduce_max_i(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}
inline __m256 ceil(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC); }
inline __m256 sign_unless_zero(__m256 level, __m256 v) {
  const __m256 nonzero = _mm256_cmp_ps(level, _mm256_setzero_ps(), _CMP_GT_OQ);
  return _mm256_or_ps(level, _mm256_and_ps(nonzero, _mm256_and_ps(v, _mm256_set1_ps(-0.f))));
}
TQK_FQ_LOOPS
}  // namespace avx2
#pragma GCC pop_options

#undef TQK_FQ_LOOPS

RowLoops row_loops(Isa isa) {
  if (isa == Isa::kAvx512Vnni) return {avx512::max_abs_bits, avx512::amax, avx512::float8, avx512::nvfp4};
  if (isa == Isa::kAvx2) return {avx2::max_abs_bits, avx2::amax, avx2::float8, avx2::nvfp4};
  return {scalar::max_abs_bits, scalar::amax, scalar::float8, scalar::nvfp4};
}

struct Plan {
  Format f;
  Float8Bits b;
  RowLoops loops;
  int64_t group;            // features per scale (MXFP8 32, NVFP4 16), 0 for one per token / tensor
  bool per_tensor;          // one scale for the tensor (or group of rows): dynamic or static
  std::optional<double> static_scale;
  float limit;              // the input dtype's largest value (core's finite_limit)
  float bound;              // the float8 scale cap
};

// One finite row xr (K float32 values, largest |value| row_amax) into yr; `tensor_scale` is the rows' per-tensor
// float8 scale or NVFP4's exponent q.
void fake_quantize_row(const Plan& p, const float* xr, float* yr, int64_t K, float row_amax, float tensor_scale) {
  const RowLoops& l = p.loops;
  if (p.group > 0) {
    const int q = static_cast<int>(tensor_scale);
    const float up = pow2(q), down = pow2(-q);
    for (int64_t k0 = 0; k0 < K; k0 += p.group) {
      const int64_t n = std::min(K - k0, p.group);
      const float amax = l.amax(xr + k0, n);
      if (p.f.fmt == Fmt::kNVFP4) l.nvfp4(xr + k0, yr + k0, n, nvfp4_block_scale(amax, up, down, p.limit));
      else l.float8(xr + k0, yr + k0, n, power_of_two_scale(amax, p.f.emax_elem), p.f, p.b);
    }
    return;
  }
  const float s = p.per_tensor ? tensor_scale : float8_scale(row_amax, p.f.max_level, p.bound);
  l.float8(xr, yr, K, s, p.f, p.b);
}

// Row r of x as float32: the row itself, or converted into buf.
template <typename T>
const float* row_as_float(const T* x, int64_t r, int64_t K, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x + r * K;
  } else {
    buf.resize(K);
    for (int64_t k = 0; k < K; ++k) buf[k] = static_cast<float>(x[r * K + k]);
    return buf.data();
  }
}

// Rows [r0, r1) of x (M, K) into y.
template <typename T>
void fake_quantize_rows(const Plan& p, const T* x, T* y, int64_t K, int64_t r0, int64_t r1,
                        const std::vector<uint8_t>& finite, const std::vector<float>& amax, float tensor_scale) {
  thread_local std::vector<float> in, out;
  for (int64_t r = r0; r < r1; ++r) {
    T* yr = y + r * K;
    if (!finite[r]) {
      std::fill(yr, yr + K, static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
      continue;
    }
    const float* xr = row_as_float(x, r, K, in);
    if constexpr (std::is_same_v<T, float>) {
      fake_quantize_row(p, xr, yr, K, amax[r], tensor_scale);
    } else {
      out.resize(K);
      fake_quantize_row(p, xr, out.data(), K, amax[r], tensor_scale);
      for (int64_t k = 0; k < K; ++k) yr[k] = static_cast<T>(out[k]);  // round to nearest even, as .to() does
    }
  }
}

// Whether each row is all finite, and the largest |finite value| of each (what a per-tensor scale spans).
template <typename T>
void scan_rows(const RowLoops& l, const T* x, int64_t M, int64_t K, std::vector<uint8_t>& finite,
               std::vector<float>& amax) {
  constexpr uint32_t kInfBits = 0x7f800000u;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      if constexpr (std::is_same_v<T, float>) {
        const uint32_t bits = l.max_abs_bits(xr, K);
        if (bits < kInfBits) {
          finite[r] = 1;
          std::memcpy(&amax[r], &bits, 4);
          continue;
        }
      }
      bool ok = true;
      float m = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const float v = static_cast<float>(xr[k]);
        ok = ok && std::isfinite(v);
        m = std::isfinite(v) ? std::max(m, std::fabs(v)) : m;
      }
      finite[r] = ok;
      amax[r] = m;
    }
  });
}

template <typename T>
void run(const Plan& p, const at::Tensor& x, at::Tensor& y, const std::vector<int64_t>& ends) {
  const int64_t M = x.size(0), K = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  std::vector<uint8_t> finite(M);
  std::vector<float> amax(M);
  scan_rows(p.loops, xp, M, K, finite, amax);
  const bool tensor_wide = p.f.fmt == Fmt::kNVFP4 || (p.per_tensor && !p.static_scale);
  int64_t start = 0;
  for (const int64_t stop : ends) {
    const int64_t r1 = std::min(stop, M);
    if (r1 <= start) continue;
    float tensor_scale = 0.f;
    if (p.static_scale) {
      tensor_scale = static_cast<float>(*p.static_scale);
    } else if (tensor_wide) {
      float top = 0.f;
      for (int64_t r = start; r < r1; ++r) top = std::max(top, amax[r]);
      tensor_scale = p.f.fmt == Fmt::kNVFP4 ? static_cast<float>(nvfp4_exponent(top / 6.f))
                                            : float8_scale(top, p.f.max_level, p.bound);
    }
    at::parallel_for(start, r1, 4, [&](int64_t r0, int64_t r_end) {
      fake_quantize_rows(p, xp, yp, K, r0, r_end, finite, amax, tensor_scale);
    });
    start = r1;
  }
  if (start < M) std::copy(xp + start * K, xp + M * K, yp + start * K);  // rows past the last group end
}

const char* const kVector =
    "per token (or per tensor): each scale by the reference's scalar arithmetic, the values rounded 16 (avx512) or "
    "8 (avx2) at a time by exponent arithmetic (float8: ties to even; e2m1: ties towards zero), bit for bit the "
    "reference's; parallel over tokens";
const DescribeOp kDescribed(OpDescription(kOp)
                                .at("avx512_vnni", kVector)
                                .at("avx2", kVector)
                                .at("scalar", "the same, one value at a time (c10's float8 conversion)"));

}  // namespace

at::Tensor fake_quantize_activation(const at::Tensor& x, std::string qdtype, int64_t group_size, bool per_tensor,
                                    std::optional<double> static_scale, const std::optional<at::Tensor>& offs) {
  const Format f = parse_format(qdtype);
  TORCH_CHECK_VALUE(x.dim() >= 1 && (x.dim() == 2 || !offs.has_value()), kOp,
                    ": x must be (..., features), and (tokens, features) with group ends, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
                    ": x must be float32, bfloat16 or float16, got ", dtype);
  const bool nvfp4 = f.fmt == Fmt::kNVFP4;
  TORCH_CHECK_VALUE(nvfp4 ? group_size == 16 && !per_tensor && !static_scale
                          : group_size == 0 || (group_size == 32 && !per_tensor && !static_scale),
                    kOp, ": ", qdtype, " with group_size ", group_size, ", per_tensor ", per_tensor,
                    static_scale ? ", a static scale" : "", " is not an activation format: NVFP4 is fp4_e2m1 per 16 "
                    "(dynamic), MXFP8 float8 per 32 (dynamic), else float8 per token or per tensor");
  TORCH_CHECK_VALUE(!(f.fmt == Fmt::kE4M3FNUZ || f.fmt == Fmt::kE5M2FNUZ) || group_size == 0, kOp,
                    ": MXFP8 elements are OCP float8, not ", qdtype);
  TORCH_CHECK_VALUE(!static_scale || (std::isfinite(*static_scale) && *static_scale > 0), kOp,
                    ": static_scale must be a finite positive float, got ", *static_scale);
  const Isa isa = selected_isa_for_ops();
  Plan p{f, f.fmt == Fmt::kNVFP4 ? Float8Bits{} : float8_bits(f), row_loops(isa), group_size,
         per_tensor || static_scale.has_value(), static_scale, 0.f, 0.f};
  const double limit = dtype == at::kFloat ? std::numeric_limits<float>::max()
                       : dtype == at::kBFloat16 ? static_cast<double>(std::numeric_limits<c10::BFloat16>::max())
                                                : 65504.0;
  p.limit = static_cast<float>(limit);
  p.bound = static_cast<float>(limit * (1.0 - kFloatEps) / f.max_level);
  const int64_t K = x.size(-1), M = K > 0 ? x.numel() / K : 0;
  const at::Tensor xc = x.contiguous().view({M, K});  // the leading dims as tokens, as F.linear takes them
  at::Tensor y = at::empty_like(xc);
  std::vector<int64_t> ends{M};
  if (offs.has_value()) {
    TORCH_CHECK_VALUE(offs->dim() == 1 && !offs->is_floating_point(), kOp,
                      ": offs must be a 1-d integer tensor of group ends, got ", offs->scalar_type(), " ",
                      offs->sizes());
    const at::Tensor o = offs->to(at::kLong).contiguous();
    ends.assign(o.const_data_ptr<int64_t>(), o.const_data_ptr<int64_t>() + o.numel());
  }
  if (xc.numel() == 0) return y.view(x.sizes());
  switch (dtype) {
    case at::kFloat: run<float>(p, xc, y, ends); break;
    case at::kBFloat16: run<c10::BFloat16>(p, xc, y, ends); break;
    default: run<c10::Half>(p, xc, y, ends); break;
  }
  return y.view(x.sizes());
}

}  // namespace torchqkit_cpu
