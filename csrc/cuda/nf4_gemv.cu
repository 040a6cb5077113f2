// NF4 dequant-GEMV: one warp per weight row, kGemvMRows activation rows per block row (gemv_rows.cuh), codes decoded in
// registers with the shared helpers (csrc/common/dequant.h), absmax read or double-dequantized per block.
#include <cstdint>

#include "../common/dequant.h"
#include "gemv_rows.cuh"
#include "kernels.h"

namespace torchqkit_cuda {
namespace {

namespace tc = torchqkit_common;

template <typename T>
__global__ void __launch_bounds__(32 * kGemvWarps) nf4_gemv_kernel(const Nf4Args a) {
  const GemvRow r = gemv_row();
  const int64_t n = r.n, m0 = r.m0;
  if (n >= a.N) return;
  const T* x = static_cast<const T*>(a.x);
  const uint8_t* row = a.q + n * (a.K / 2);
  const int64_t blocks_per_row = a.K / a.block;
  float acc[kGemvMRows] = {};
  // ---- each lane takes one byte (two k) per step; both k lie in one NF4 block (the block is even) ----
  for (int64_t k = 2 * r.lane; k < a.K; k += 64) {
    const int64_t flat = n * blocks_per_row + k / a.block;
    const float absmax = a.absmax != nullptr
        ? a.absmax[flat]
        : tc::nf4_dq_absmax(a.absmax_codes[flat], a.absmax_scale[flat / tc::kNf4DqGroup], a.absmax_offset[0]);
    const float w0 = tc::nf4_level(tc::nf4_code(row, k)) * absmax;
    const float w1 = tc::nf4_level(tc::nf4_code(row, k + 1)) * absmax;
#pragma unroll
    for (int i = 0; i < kGemvMRows; ++i) {
      if (m0 + i < a.M) {
        const T* xr = x + (m0 + i) * a.ldx + k;
        acc[i] += to_float(xr[0]) * w0 + to_float(xr[1]) * w1;
      }
    }
  }
  gemv_store<T>(r, acc, a.M, a.bias, a.out, a.ldo);
}

template <typename T>
void launch(const Nf4Args& a, cudaStream_t stream) {
  nf4_gemv_kernel<T><<<gemv_grid(a.N, a.M), 32 * kGemvWarps, 0, stream>>>(a);
}

}  // namespace

void nf4_gemv(ActType t, const Nf4Args& a, cudaStream_t stream) {
  with_act_type(t, [&](auto v) { launch<decltype(v)>(a, stream); });
}

}  // namespace torchqkit_cuda
