// float8 weight-only GEMV: one warp per weight row, kMRows activation rows per block row; bytes decoded
// from bits with the shared helpers (csrc/common/dequant.h), so sm80 (no float8 hardware) runs it too.
#include <cstdint>

#include "../common/dequant.h"
#include "act_type.cuh"
#include "kernels.h"

namespace torchqkit_cuda {
namespace {

namespace tc = torchqkit_common;
constexpr int kWarps = 4;
constexpr int kMRows = 4;

template <typename T, bool kE5m2>
__global__ void __launch_bounds__(32 * kWarps) fp8_gemv_kernel(const Fp8Args a) {
  const int lane = threadIdx.x % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= a.N) return;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kMRows;
  const T* x = static_cast<const T*>(a.x);
  const uint8_t* row = a.q + n * a.K;
  const float* srow = a.scale + (n / a.bn) * a.scale_cols;
  float acc[kMRows] = {};
  for (int64_t k = lane; k < a.K; k += 32) {
    const float w = (kE5m2 ? tc::fp8_e5m2_to_float(row[k]) : tc::fp8_e4m3fn_to_float(row[k])) * srow[k / a.bk];
#pragma unroll
    for (int i = 0; i < kMRows; ++i) {
      if (m0 + i < a.M) acc[i] += to_float(x[(m0 + i) * a.ldx + k]) * w;
    }
  }
#pragma unroll
  for (int i = 0; i < kMRows; ++i) {
    const float v = warp_sum(acc[i]);
    if (lane == 0 && m0 + i < a.M) {
      static_cast<T*>(a.out)[(m0 + i) * a.ldo + n] = from_float<T>(v + (a.bias ? a.bias[n] : 0.f));
    }
  }
}

template <typename T>
void launch(const Fp8Args& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.N + kWarps - 1) / kWarps), static_cast<unsigned>((a.M + kMRows - 1) / kMRows));
  if (a.e5m2) fp8_gemv_kernel<T, true><<<grid, 32 * kWarps, 0, stream>>>(a);
  else fp8_gemv_kernel<T, false><<<grid, 32 * kWarps, 0, stream>>>(a);
}

}  // namespace

void fp8_gemv(ActType t, const Fp8Args& a, cudaStream_t stream) {
  if (t == ActType::kHalf) launch<__half>(a, stream);
  else if (t == ActType::kBFloat16) launch<__nv_bfloat16>(a, stream);
  else launch<float>(a, stream);
}

}  // namespace torchqkit_cuda
