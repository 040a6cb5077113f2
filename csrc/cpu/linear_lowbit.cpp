// Low-bit weight-only linear kernels for x86 (scalar, AVX2 + FMA + F16C, AVX-512 F/BW/VL/DQ): NF4 (single
// and double quantized), float8 e4m3fn / e5m2 / e4m3fnuz / e5m2fnuz, MXFP4 / MXFP8, NVFP4, FP6 e3m2 / e2m3, packed
// intx (1..7 bits).
// They read the layouts' bytes as stored (device-independent, no repacking); the bit layouts are documented in
// torchqkit/layouts/nf4.py, float8.py, mx.py, nvfp4.py, fp6.py and packed_intx.py.
//
// No torch header here (see kernels.h). The vector code is written once, in linear_lowbit_isa.h, over a
// vector-width traits struct (simd.h), and compiled here once per ISA level inside a `#pragma GCC target`
// region, so the scalar code runs on any x86-64 CPU:
//   * dot kernel (decode, small M): 4 weight rows x up to 4 (AVX-512) / 2 (AVX2) tokens per tile; weights
//     decoded in registers, 32 per step (Note [Low-bit decode steps]), group scales applied once per group
//     (Note [Group scales once per group]); each byte is read from memory once per tile of tokens.
//   * prefill (larger M): a block of rows x columns decoded to fp32 once into a per-thread L2 buffer, then the
//     same dot tiles over it (AVX-512 from kPanelMinM tokens: 6x32 FMA panels); below AVX-512 the glue hands decoded
//     rows to an fp32 GEMM (prefill_dequantized in sgemm_prefill.h: the 256-bit panels past the dot kernel, or on
//     Intel CPUs ATen's sgemm from kSgemmMinM tokens).
//   * bf16 activations on AVX512-BF16 (linear_lowbit_bf16.h): levels decoded to bf16 and multiplied by vdpbf16ps,
//     in registers (decode) or through 32-row k-pair panels (prefill, bf16_gemm.h).
#include "../common/dequant.h"
#include "bf16_gemm.h"
#include "kernels.h"
#include "scalar_linear.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace torchqkit_cpu {
namespace {

// The codebooks of csrc/common/dequant.h as aligned tables: code i -> kNf4[i] / kFp4[i] (one zmm / two ymm loads).
alignas(64) constexpr float kNf4[16] = {TORCHQKIT_NF4_LEVELS};
alignas(64) constexpr float kFp4[16] = {TORCHQKIT_FP4_E2M1_LEVELS};

// Scale and offset of group gi of the row whose scale row starts at base = (n / bn) * G (E8M0 exponents and
// double-quantized NF4 absmax decoded here, per group: no per-call scale tensor). The loops compute base
// once per row: no division per group.
inline int64_t scale_base(const LowbitArgs& p, int64_t n) { return (n / p.bn) * p.G; }
inline float scale_at(const LowbitArgs& p, int64_t base, int64_t gi) {
  const int64_t i = base + gi;
  if (p.scale) return p.scale[i] * p.scale_mul;
  if (p.scale_e4m3) return nvfp4_block_scale(p.scale_e4m3[i], p.e4m3_global) * p.scale_mul;
  if (p.scale_e8m0) {  // 2^(e - 127): float bits e << 23; e = 0 is the subnormal 2^-127 (bits 0x00400000)
    const uint32_t e = p.scale_e8m0[i], bits = e ? e << 23 : 0x00400000u;
    float s;
    std::memcpy(&s, &bits, 4);
    return s * p.scale_mul;
  }
  return (float)p.dq_codes[i] * p.dq_scale[i >> 8] + p.dq_offset;
}
inline float offset_at(const LowbitArgs& p, int64_t base, int64_t gi) { return p.offset ? p.offset[base + gi] : 0.f; }
inline float row_scale(const LowbitArgs& p, int64_t n, int64_t gi) { return scale_at(p, scale_base(p, n), gi); }
inline float row_offset(const LowbitArgs& p, int64_t n, int64_t gi) { return offset_at(p, scale_base(p, n), gi); }

// Steps of 32 weights (Note [Low-bit decode steps]) share one scale when groups are whole steps (or one group
// spans the row); otherwise each lane needs its group's scale (the fp32 block decode does that).
inline bool steps_aligned(const LowbitArgs& p) { return p.G == 1 || p.g % 32 == 0; }

// out[m, n] = v (+ out[m, n] when accumulating k blocks) (+ bias[n]).
inline void store(const LowbitArgs& p, int64_t m, int64_t n, float v) {
  float* o = p.out + m * p.ldo + n;
  *o = (p.accumulate ? *o : 0.f) + v + (p.bias ? p.bias[n] : 0.f);
}

constexpr int64_t kPrefillRows = 32;   // 32 rows x 1024 k of fp32 = 128 KiB: the decoded block stays in L2
constexpr int64_t kPrefillK = 1024;

// The dot kernels' view of a decoded fp32 block: rows b0..b0+nb of the output, columns k0..k0+kc of x,
// scale 1, no offset; accumulates after the first k block, adds the bias on the last.
LowbitArgs block_args(const LowbitArgs& p, const float* buf, const float* one, int64_t b0, int64_t nb, int64_t k0,
                      int64_t kc) {
  LowbitArgs q = p;
  q.x = p.x + k0;
  q.K = kc;
  q.w = reinterpret_cast<const uint8_t*>(buf);
  q.ldw = kPrefillK * sizeof(float);
  q.N = nb;
  q.scale = one;
  q.scale_mul = 1.f;
  q.offset = nullptr;
  q.G = 1;
  q.g = kc;
  q.bn = nb;
  q.out = p.out + b0;
  q.bias = k0 + kc == p.K && p.bias ? p.bias + b0 : nullptr;
  q.accumulate = k0 > 0;
  return q;
}

// ================================================================================================
// Scalar
// ================================================================================================
namespace scalar {

float fp8_e4m3(uint8_t b) {  // value / 256 (the glue folds 256 into the scale; see kernels.h)
  const int e = (b >> 3) & 0xF, m = b & 7;
  float v;
  if ((b & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0) v = std::ldexp((float)m, -9);
  else v = std::ldexp(1.f + m / 8.f, e - 7);
  v *= 1.f / 256.f;
  return (b & 0x80) ? -v : v;
}

float fp8_e5m2(uint8_t b) {
  const int e = (b >> 2) & 0x1F, m = b & 3;
  float v;
  if (e == 31) v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else if (e == 0) v = std::ldexp((float)m, -16);
  else v = std::ldexp(1.f + m / 4.f, e - 15);
  return (b & 0x80) ? -v : v;
}

// An FP6 code's value (e3m2: mant = 2, e2m3: mant = 3), as the vector decoders yield (Note [FP6 through fp16]).
float fp6(uint32_t f, int mant) {
  const int bias = mant == 2 ? 3 : 1, mag = f & 31, e = mag >> mant, m = mag & ((1 << mant) - 1);
  const float v = e ? std::ldexp((float)((1 << mant) + m), e - bias - mant) : std::ldexp((float)m, 1 - bias - mant);
  return (f & 32) ? -v : v;
}

uint32_t field(const uint8_t* row, int64_t k, int bits) {
  const int64_t bit = k * bits, byte = bit >> 3;
  uint32_t v = row[byte];
  if (((bit & 7) + bits) > 8) v |= (uint32_t)row[byte + 1] << 8;
  return (v >> (bit & 7)) & ((1u << bits) - 1);
}

float level(const LowbitArgs& p, const uint8_t* row, int64_t k) {
  switch (p.fmt) {
    case LowbitFormat::kFp6E3m2: return fp6(field(row, k, 6), 2);
    case LowbitFormat::kFp6E2m3: return fp6(field(row, k, 6), 3);
    case LowbitFormat::kNf4: return kNf4[(k & 1) ? row[k >> 1] & 0xF : row[k >> 1] >> 4];
    case LowbitFormat::kFp4E2m1: return kFp4[(k & 1) ? row[k >> 1] >> 4 : row[k >> 1] & 0xF];
    case LowbitFormat::kFloat8E4m3: return fp8_e4m3(row[k]);
    case LowbitFormat::kFloat8E5m2: return fp8_e5m2(row[k]);
    // the vector decoders' values (Note [float8 fnuz bytes]): e4m3fnuz / 128 (exact: a power of two)
    case LowbitFormat::kFloat8E4m3Fnuz: return torchqkit_common::fp8_e4m3fnuz_to_float(row[k]) * (1.f / 128.f);
    case LowbitFormat::kFloat8E5m2Fnuz: return torchqkit_common::fp8_e5m2fnuz_to_float(row[k]);
    default: return (float)((int)field(row, k, p.bits) + p.code_offset);
  }
}

float weight(const LowbitArgs& p, const uint8_t* row, int64_t n, int64_t k) {
  const int64_t gi = k / p.g;
  return level(p, row, k) * row_scale(p, n, gi) + row_offset(p, n, gi);
}

void dot(const LowbitArgs& p, int64_t n0, int64_t n1) {
  scalar_linear(p.M, n0, n1, p.bias, p.out, p.ldo, [&](int64_t n, int64_t m) {
    const uint8_t* row = p.w + n * p.ldw;
    const float* xr = p.x + m * p.ldx;
    float acc = 0.f;
    for (int64_t k = 0; k < p.K; ++k) acc += xr[k] * weight(p, row, n, k);
    return acc;
  });
}

void decode(const LowbitArgs& p, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
  const int64_t k32 = (p.K + 31) / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.ldw;
    float* d = dst + (n - n0) * ldd;
    for (int64_t k = 0; k < p.K; ++k) d[k] = weight(p, row, n, k);
    for (int64_t k = p.K; k < k32; ++k) d[k] = 0.f;
  }
}

}  // namespace scalar

// Fn<decoder>::run(p, a...) for the format of p, the decoder types taken from an ISA level's Decoders.
template <class Dec, template <class> class Fn, class... A>
void by_format(const LowbitArgs& p, A... a) {
  switch (p.fmt) {
    case LowbitFormat::kNf4: return Fn<typename Dec::nf4>::run(p, a...);
    case LowbitFormat::kFp4E2m1: return Fn<typename Dec::fp4>::run(p, a...);
    case LowbitFormat::kFloat8E4m3: return Fn<typename Dec::e4m3>::run(p, a...);
    case LowbitFormat::kFloat8E5m2: return Fn<typename Dec::e5m2>::run(p, a...);
    case LowbitFormat::kFloat8E4m3Fnuz: return Fn<typename Dec::e4m3fnuz>::run(p, a...);
    case LowbitFormat::kFloat8E5m2Fnuz: return Fn<typename Dec::e5m2fnuz>::run(p, a...);
    case LowbitFormat::kFp6E3m2: return Fn<typename Dec::fp6_e3m2>::run(p, a...);
    case LowbitFormat::kFp6E2m3: return Fn<typename Dec::fp6_e2m3>::run(p, a...);
    default: break;
  }
  switch (p.bits) {
    case 1: return Fn<typename Dec::template intx<1>>::run(p, a...);
    case 2: return Fn<typename Dec::template intx<2>>::run(p, a...);
    case 3: return Fn<typename Dec::template intx<3>>::run(p, a...);
    case 4: return Fn<typename Dec::template intx<4>>::run(p, a...);
    case 5: return Fn<typename Dec::template intx<5>>::run(p, a...);
    case 6: return Fn<typename Dec::template intx<6>>::run(p, a...);
    default: return Fn<typename Dec::template intx<7>>::run(p, a...);
  }
}

// ================================================================================================
// AVX-512 F/BW/VL/DQ: 16 lanes
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
using V = Vec512;
#include "linear_lowbit_isa.h"

// M >= kPanelMinM: 32 decoded rows transposed into a k-major panel [kc][32] for the 6x32 FMA micro-kernel
// shared with the int8 / int4 kernels (gemm_f32_6x32, linear_int8.cpp): activations broadcast, weights
// streamed from L1, the register-blocked GEMM shape.
constexpr int64_t kPanelMinM = 64;  // below: the dot-tile prefill (bench_linear.py --formats, M = 32)
constexpr int64_t kPanelK = 256;  // 256 x 32 fp32 = 32 KiB panel

template <class D>
void prefill_panel(const LowbitArgs& p, int64_t n0, int64_t n1) {
  AlignedVector<float> rows(32 * kPanelK), panel(kPanelK * 32);
  for (int64_t b0 = n0; b0 < n1; b0 += 32) {
    const int nb = (int)std::min<int64_t>(32, n1 - b0);
    for (int64_t k0 = 0; k0 < p.K; k0 += kPanelK) {
      const int64_t kc = std::min<int64_t>(kPanelK, p.K - k0);
      decode_rows<D>(p, b0, b0 + nb, k0, k0 + kc, rows.data(), kPanelK);
      for (int64_t k = 0; k < kc; ++k)
        for (int j = 0; j < 32; ++j) panel[k * 32 + j] = j < nb ? rows[j * kPanelK + k] : 0.f;
      for (int64_t m = 0; m < p.M; m += 6)
        gemm_f32_6x32((int)std::min<int64_t>(6, p.M - m), p.x + m * p.ldx + k0, p.ldx, panel.data(), kc,
                      p.out + m * p.ldo + b0, p.ldo, nb, k0 == 0);
    }
    if (p.bias) {
      const __mmask16 m0 = nb >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nb) - 1);
      const __mmask16 m1 = nb >= 32 ? (__mmask16)0xFFFF : nb <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nb - 16)) - 1);
      const __m512 bv0 = _mm512_maskz_loadu_ps(m0, p.bias + b0), bv1 = _mm512_maskz_loadu_ps(m1, p.bias + b0 + 16);
      for (int64_t m = 0; m < p.M; ++m) {
        float* o = p.out + m * p.ldo + b0;
        _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), bv0));
        _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), bv1));
      }
    }
  }
}

template <class D> struct PrefillFn {
  static void run(const LowbitArgs& p, int64_t n0, int64_t n1) {
    p.M >= kPanelMinM ? prefill_panel<D>(p, n0, n1) : prefill<D>(p, n0, n1);
  }
};

}  // namespace avx512
#pragma GCC pop_options

// ================================================================================================
// AVX2 + FMA + F16C: 8 lanes
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using V = Vec256;
#include "linear_lowbit_isa.h"

template <class D> struct PrefillFn { static void run(const LowbitArgs& p, int64_t n0, int64_t n1) { prefill<D>(p, n0, n1); } };

}  // namespace avx2
#pragma GCC pop_options

// ================================================================================================
// AVX-512 + AVX512-BF16: the same decoders, levels rounded to bf16, vdpbf16ps (bf16 activations only)
// ================================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace avx512_bf16 {
using V = Vec512;
#include "linear_lowbit_isa.h"
#include "linear_lowbit_bf16.h"
}  // namespace avx512_bf16
#pragma GCC pop_options

// Every AVX2 CPU also has F16C (float8 decode); a CPU without it runs the scalar level.
Isa lowbit_isa(Isa isa) {
  __builtin_cpu_init();
  if (isa == Isa::kAvx2 && !__builtin_cpu_supports("f16c")) return Isa::kScalar;
  return isa;
}

}  // namespace

// LowbitArgs::xb (bf16 activations) runs the AVX512-BF16 kernels; fp32 activations at that level run AVX-512's.
void linear_lowbit_dot(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1) {
  switch (lowbit_isa(isa)) {
    case Isa::kAvx512Bf16:
      if (p.xb) return by_format<avx512_bf16::Decoders, avx512_bf16::DotBf16Fn>(p, n0, n1);
      return by_format<avx512::Decoders, avx512::DotFn>(p, n0, n1);
    case Isa::kAvx512Vnni: return by_format<avx512::Decoders, avx512::DotFn>(p, n0, n1);
    case Isa::kAvx2: return by_format<avx2::Decoders, avx2::DotFn>(p, n0, n1);
    default: return scalar::dot(p, n0, n1);
  }
}

void linear_lowbit_prefill(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1) {
  switch (lowbit_isa(isa)) {
    case Isa::kAvx512Bf16:
      if (p.xb) return by_format<avx512_bf16::Decoders, avx512_bf16::PrefillBf16Fn>(p, n0, n1);
      return by_format<avx512::Decoders, avx512::PrefillFn>(p, n0, n1);
    case Isa::kAvx512Vnni: return by_format<avx512::Decoders, avx512::PrefillFn>(p, n0, n1);
    case Isa::kAvx2: return by_format<avx2::Decoders, avx2::PrefillFn>(p, n0, n1);
    default: return scalar::dot(p, n0, n1);
  }
}

bool lowbit_bf16_dot_order(const LowbitArgs& p, int64_t* perm) {
  by_format<avx512_bf16::Decoders, avx512_bf16::DotOrderFn>(p, perm);
  for (int i = 0; i < 32; ++i)
    if (perm[i] != i) return true;
  return false;
}

void linear_lowbit_decode(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
  if (lowbit_isa(isa) == Isa::kScalar) return scalar::decode(p, n0, n1, dst, ldd);
  by_format<avx2::Decoders, avx2::DecodeFn>(p, n0, n1, dst, ldd);  // AVX-512 CPUs run AVX2 too
}

}  // namespace torchqkit_cpu
