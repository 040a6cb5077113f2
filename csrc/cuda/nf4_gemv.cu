// NF4 dequant-GEMV: one warp per weight row, kMRows activation rows per block row, codes decoded in
// registers with the shared helpers (csrc/common/dequant.h), absmax read or double-dequantized per block.
#include <cstdint>

#include "../common/dequant.h"
#include "act_type.cuh"
#include "kernels.h"

namespace torchqkit_cuda {
namespace {

namespace tc = torchqkit_common;
constexpr int kWarps = 4;   // weight rows per block
constexpr int kMRows = 4;   // activation rows per block

template <typename T>
__global__ void __launch_bounds__(32 * kWarps) nf4_gemv_kernel(const Nf4Args a) {
  const int lane = threadIdx.x % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= a.N) return;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kMRows;
  const T* x = static_cast<const T*>(a.x);
  const uint8_t* row = a.q + n * (a.K / 2);
  const int64_t blocks_per_row = a.K / a.block;
  float acc[kMRows] = {};
  // ---- each lane takes one byte (two k) per step; both k lie in one NF4 block (the block is even) ----
  for (int64_t k = 2 * lane; k < a.K; k += 64) {
    const int64_t flat = n * blocks_per_row + k / a.block;
    const float absmax = a.absmax != nullptr
        ? a.absmax[flat]
        : tc::nf4_dq_absmax(a.absmax_codes[flat], a.absmax_scale[flat / tc::kNf4DqGroup], a.absmax_offset[0]);
    const float w0 = tc::nf4_level(tc::nf4_code(row, k)) * absmax;
    const float w1 = tc::nf4_level(tc::nf4_code(row, k + 1)) * absmax;
#pragma unroll
    for (int i = 0; i < kMRows; ++i) {
      if (m0 + i < a.M) {
        const T* xr = x + (m0 + i) * a.ldx + k;
        acc[i] += to_float(xr[0]) * w0 + to_float(xr[1]) * w1;
      }
    }
  }
  // ---- reduce across the warp, bias, store ----
#pragma unroll
  for (int i = 0; i < kMRows; ++i) {
    const float v = warp_sum(acc[i]);
    if (lane == 0 && m0 + i < a.M) {
      static_cast<T*>(a.out)[(m0 + i) * a.ldo + n] = from_float<T>(v + (a.bias ? a.bias[n] : 0.f));
    }
  }
}

template <typename T>
void launch(const Nf4Args& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.N + kWarps - 1) / kWarps), static_cast<unsigned>((a.M + kMRows - 1) / kMRows));
  nf4_gemv_kernel<T><<<grid, 32 * kWarps, 0, stream>>>(a);
}

}  // namespace

void nf4_gemv(ActType t, const Nf4Args& a, cudaStream_t stream) {
  if (t == ActType::kHalf) launch<__half>(a, stream);
  else if (t == ActType::kBFloat16) launch<__nv_bfloat16>(a, stream);
  else launch<float>(a, stream);
}

}  // namespace torchqkit_cuda
