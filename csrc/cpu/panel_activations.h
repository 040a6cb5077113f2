// Activations as the panel kernels read them, made once per call by the ops' glue. The bf16 panels (bf16_gemm.h):
// x rounded to bf16 (bf16 activations, or float32 ones when torch's fp32 matmul precision allows bf16: Note [fp32
// activations in bf16]), or at the amx level float32 activations split into three bf16 planes that sum to x exactly
// (Note [fp32 activations on AMX] in amx_bf16_gemm.h), so float32 keeps its precision on the AMX tiles.
#pragma once
#include <ATen/ATen.h>

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

// x2: (M, K) activations; ldx >= K (a multiple of 32) the columns the kernels read. planes 3: float32 x = hi + mid
// + lo (each the bf16 rounding of what the planes before it left: the differences are exact in fp32, the last
// remainder exact in bf16); planes 1: bf16(x). amx_packed: in the AMX tiles' order (amx_bf16_gemm.h), else (M, ldx).
inline Bf16Activations bf16_activations(const at::Tensor& x2, int64_t ldx, int planes, bool amx_packed) {
  const int64_t M = x2.size(0), K = x2.size(1);
  at::Tensor data;
  if (planes == 1) {
    data = x2.to(at::kBFloat16);
  } else {
    const at::Tensor x = x2.to(at::kFloat);
    const at::Tensor hi = x.to(at::kBFloat16), r1 = x - hi.to(at::kFloat);
    const at::Tensor mid = r1.to(at::kBFloat16), lo = (r1 - mid.to(at::kFloat)).to(at::kBFloat16);
    data = at::stack({hi, mid, lo}, 1);  // (M, 3, K)
  }
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
  return at::constant_pad_nd(a, {0, 0, 0, Mb * R - M}, 0).view({Mb, R, lda / 64, 64}).permute({0, 2, 1, 3}).contiguous();
}

}  // namespace torchqkit_cpu
