// The launch shape and the epilogue shared by the weight-only GEMV kernels (fp8_gemv.cu, nf4_gemv.cu):
// one warp per weight row, kGemvMRows activation rows per block row; each lane sums its k of the row, and
// the warp's sums go out once per activation row with the bias added.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "act_type.cuh"
#include "kernels.h"

namespace torchqkit_cuda {

constexpr int kGemvWarps = 4;  // weight rows per block
constexpr int kGemvMRows = 4;  // activation rows per block

inline dim3 gemv_grid(int64_t N, int64_t M) {
  return dim3(static_cast<unsigned>((N + kGemvWarps - 1) / kGemvWarps),
              static_cast<unsigned>((M + kGemvMRows - 1) / kGemvMRows));
}

// The weight row (n) and the first activation row (m0) of this thread's warp; n >= N means no work.
struct GemvRow {
  int lane;
  int64_t n, m0;
};

__device__ __forceinline__ GemvRow gemv_row() {
  return {static_cast<int>(threadIdx.x % 32), static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32,
          static_cast<int64_t>(blockIdx.y) * kGemvMRows};
}

// out[m0 + i, n] = (sum over the warp of acc[i]) + bias[n], for the rows i with m0 + i < M.
template <typename T>
__device__ __forceinline__ void gemv_store(const GemvRow& r, const float (&acc)[kGemvMRows], int64_t M,
                                           const float* bias, void* out, int64_t ldo) {
#pragma unroll
  for (int i = 0; i < kGemvMRows; ++i) {
    const float v = warp_sum(acc[i]);
    if (r.lane == 0 && r.m0 + i < M) {
      static_cast<T*>(out)[(r.m0 + i) * ldo + r.n] = from_float<T>(v + (bias ? bias[r.n] : 0.f));
    }
  }
}

// Calls launch(T{}) with T the activation element type t names (half, bf16 or float): the caller's generic
// lambda takes the type from its argument, [&](auto v) { kernel<decltype(v)><<<...>>>(...); }.
template <class Launch>
void with_act_type(ActType t, Launch launch) {
  if (t == ActType::kHalf) launch(__half{});
  else if (t == ActType::kBFloat16) launch(__nv_bfloat16{});
  else launch(float{});
}

}  // namespace torchqkit_cuda
