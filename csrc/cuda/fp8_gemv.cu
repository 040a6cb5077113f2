// float8 weight-only GEMV: one warp per weight row, kGemvMRows activation rows per block row (gemv_rows.cuh); bytes decoded
// from bits with the shared helpers (csrc/common/dequant.h), so sm80 (no float8 hardware) runs it too.
#include <cstdint>

#include "../common/dequant.h"
#include "gemv_rows.cuh"
#include "kernels.h"

namespace torchqkit_cuda {
namespace {

namespace tc = torchqkit_common;

template <Fp8Kind kKind>
__device__ __forceinline__ float fp8_value(uint8_t b) {
  if constexpr (kKind == Fp8Kind::kE5m2) return tc::fp8_e5m2_to_float(b);
  else if constexpr (kKind == Fp8Kind::kE4m3fnuz) return tc::fp8_e4m3fnuz_to_float(b);
  else if constexpr (kKind == Fp8Kind::kE5m2fnuz) return tc::fp8_e5m2fnuz_to_float(b);
  else return tc::fp8_e4m3fn_to_float(b);
}

template <typename T, Fp8Kind kKind>
__global__ void __launch_bounds__(32 * kGemvWarps) fp8_gemv_kernel(const Fp8Args a) {
  const GemvRow r = gemv_row();
  const int64_t n = r.n, m0 = r.m0;
  if (n >= a.N) return;
  const T* x = static_cast<const T*>(a.x);
  const uint8_t* row = a.q + n * a.K;
  const float* srow = a.scale + (n / a.bn) * a.scale_cols;
  float acc[kGemvMRows] = {};
  for (int64_t k = r.lane; k < a.K; k += 32) {
    const float w = fp8_value<kKind>(row[k]) * srow[k / a.bk];
#pragma unroll
    for (int i = 0; i < kGemvMRows; ++i) {
      if (m0 + i < a.M) acc[i] += to_float(x[(m0 + i) * a.ldx + k]) * w;
    }
  }
  gemv_store<T>(r, acc, a.M, a.bias, a.out, a.ldo);
}

template <typename T>
void launch(const Fp8Args& a, cudaStream_t stream) {
  const dim3 grid = gemv_grid(a.N, a.M);
  switch (a.kind) {
    case Fp8Kind::kE5m2: fp8_gemv_kernel<T, Fp8Kind::kE5m2><<<grid, 32 * kGemvWarps, 0, stream>>>(a); break;
    case Fp8Kind::kE4m3fnuz: fp8_gemv_kernel<T, Fp8Kind::kE4m3fnuz><<<grid, 32 * kGemvWarps, 0, stream>>>(a); break;
    case Fp8Kind::kE5m2fnuz: fp8_gemv_kernel<T, Fp8Kind::kE5m2fnuz><<<grid, 32 * kGemvWarps, 0, stream>>>(a); break;
    default: fp8_gemv_kernel<T, Fp8Kind::kE4m3fn><<<grid, 32 * kGemvWarps, 0, stream>>>(a); break;
  }
}

}  // namespace

void fp8_gemv(ActType t, const Fp8Args& a, cudaStream_t stream) {
  with_act_type(t, [&](auto v) { launch<decltype(v)>(a, stream); });
}

}  // namespace torchqkit_cuda
