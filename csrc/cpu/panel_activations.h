// Activations as the panel kernels read them, made once per call by the ops' glue. The bf16 panels (bf16_gemm.h):
// x rounded to bf16 (bf16 activations, or float32 ones when torch's fp32 matmul precision allows bf16: Note [fp32
// activations in bf16]), or at the amx level float32 activations split into three bf16 planes that sum to x exactly
// (Note [fp32 activations on AMX] in amx_bf16_gemm.h), so float32 keeps its precision on the AMX tiles.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include "parallel.h"

#include "amx_bf16_gemm.h"
#include "amx_tiles.h"
#include "fp32_matmul_precision.h"
#include "kernels.h"

namespace torchqkit_cpu {

// Float32 activations of a weight-only prefill take the AMX planes: the amx level, and torch's fp32 matmul
// precision asks for fp32 (under "medium" one bf16 plane is what the user allowed, and 3x faster).
inline bool fp32_takes_amx_planes(at::ScalarType dt) {
  return dt == at::kFloat && amx_selected() && !fp32_matmul_allows_bf16();
}

struct Bf16Activations {
  at::Tensor data;  // (M, ldx) bf16, columns K..ldx-1 zero; packed for AMX: Note [activations packed for AMX]
  int planes;
  int64_t ldx;
  const uint16_t* ptr() const { return reinterpret_cast<const uint16_t*>(data.data_ptr()); }
};

// 32-token blocks [b0, b1) of float32 x (M, K) as three packed bf16 planes (Note [activations packed for AMX]):
// hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), one pass over x (the same split with ATen ops took
// 8 passes, as long as the tiles' work at M = 1000, K = 1536, N = 384). Zero past M and K.
#define TQK_PLANES __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
TQK_PLANES inline __m512 widen_bf16(__m256bh h) {  // 16 bf16 -> their exact float32 values
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

TQK_PLANES inline void pack_fp32_planes(const float* x, int64_t M, int64_t K, int64_t ldx, uint16_t* dst, int64_t b0,
                                        int64_t b1) {
  const int64_t R = amx::kBlockRows, steps = ldx / 32;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t m = b * R + r;
      for (int64_t s = 0; s < steps; ++s)
        for (int h = 0; h < 2; ++h) {
          const int64_t k = s * 32 + h * 16;
          const __mmask16 in =
              m < M && k < K ? (K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1)) : 0;
          const __m512 v = _mm512_maskz_loadu_ps(in, x + m * K + k);
          const __m256bh hi = _mm512_cvtneps_pbh(v);
          const __m512 r1 = _mm512_sub_ps(v, widen_bf16(hi));
          const __m256bh mid = _mm512_cvtneps_pbh(r1);
          const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen_bf16(mid)));
          uint16_t* d = dst + ((b * steps + s) * 3) * (R * 32) + r * 32 + h * 16;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), (__m256i)hi);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + R * 32), (__m256i)mid);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * R * 32), (__m256i)lo);
        }
    }
}
#undef TQK_PLANES

// x2: (M, K) activations; ldx >= K (a multiple of 32) the columns the kernels read. planes 3 (float32 x, packed
// for AMX only): x = hi + mid + lo (each the bf16 rounding of what the planes before it left: the differences are
// exact in fp32, the last remainder exact in bf16); planes 1: bf16(x). amx_packed: in the AMX tiles' order
// (amx_bf16_gemm.h), else (M, ldx).
inline Bf16Activations bf16_activations(const at::Tensor& x2, int64_t ldx, int planes, bool amx_packed) {
  const int64_t M = x2.size(0), K = x2.size(1);
  if (planes == 3) {
    TORCH_CHECK(amx_packed && x2.scalar_type() == at::kFloat, "three bf16 planes: float32 x, packed for AMX only");
    const int64_t R = amx::kBlockRows, Mb = (M + R - 1) / R;
    const at::Tensor x = x2.contiguous();
    at::Tensor data = at::empty({Mb, ldx / 32, 3, R, 32}, x.options().dtype(at::kBFloat16));
    at::parallel_for(0, Mb, 1, [&](int64_t b0, int64_t b1) {
      pack_fp32_planes(x.data_ptr<float>(), M, K, ldx, reinterpret_cast<uint16_t*>(data.data_ptr()), b0, b1);
    });
    return {data, 3, ldx};
  }
  at::Tensor data = x2.to(at::kBFloat16);
  if (!amx_packed) return {at::constant_pad_nd(data, {0, ldx - K}, 0).contiguous(), planes, ldx};
  const int64_t R = amx::kBlockRows, Mb = (M + R - 1) / R;
  data = at::constant_pad_nd(data.reshape({M, planes, K}), {0, ldx - K, 0, 0, 0, Mb * R - M}, 0);
  data = data.view({Mb, R, planes, ldx / 32, 32}).permute({0, 3, 2, 1, 4}).contiguous();
  return {data, planes, ldx};
}

// (M, G) fp32 sums of the activations over groups of g (G * g <= ldx) as the panels see them: x itself for three
// planes (their sum), bf16(x) for one. A reduction, not a matmul: fp32 at any matmul precision.
inline at::Tensor group_sums(const at::Tensor& x2, int planes, int64_t G, int64_t g) {
  const int64_t M = x2.size(0), K = x2.size(1);
  at::Tensor xf = (planes == 1 ? x2.to(at::kBFloat16) : x2).to(at::kFloat);
  if (G * g > K) xf = at::constant_pad_nd(xf, {0, G * g - K}, 0);
  return xf.reshape({M, G, g}).sum(-1).contiguous();
}

// The int8 dynamic-activation codes (M, lda) (lda % 64 == 0) packed for the AMX tiles: [ceil(M / 32)][lda / 64]
// [32 rows][64 k] u8, rows past M zero (Note [int8 panels on AMX] in amx_int8_gemm.h).
inline at::Tensor amx_packed_codes(const at::Tensor& a) {
  const int64_t M = a.size(0), lda = a.size(1), R = amx::kBlockRows, Mb = (M + R - 1) / R;
  const at::Tensor rows = at::constant_pad_nd(a, {0, 0, 0, Mb * R - M}, 0);
  return rows.view({Mb, R, lda / 64, 64}).permute({0, 2, 1, 3}).contiguous();
}

}  // namespace torchqkit_cpu
