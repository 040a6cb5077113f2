// The prefill below AVX-512, shared by the int4 and the low-bit weight-only ops: without AVX-512 there is no
// fp32 panel micro-kernel, so from some M on, blocks of kSgemmRows weight rows are dequantized once (in
// parallel, by the format's decoder) and multiplied by ATen's fp32 GEMM (oneDNN / MKL, at the CPU's own best
// ISA). The GEMM runs outside the parallel region: called inside at::parallel_for it ran 250x slower (nested
// OpenMP).
#pragma once
#include <ATen/ATen.h>
#include "parallel.h"

#include <algorithm>

namespace torchqkit_cpu {

constexpr int64_t kSgemmRows = 512;  // 8 MB of fp32 rows at K = 4096

// out (M, N) = x (M, k) W^T + bias, W's rows [r0, r1) written by decode(r0, r1, dst) at dst, row stride ldd
// (>= k; columns past k are not read). Rows are handed out in whole multiples of `grain`, which divides
// kSgemmRows (an int4 n-tile is 8 rows).
template <class Decode>
void prefill_by_sgemm(const at::Tensor& x, int64_t N, int64_t ldd, int64_t grain, const float* bias,
                      at::Tensor& out, Decode decode) {
  at::Tensor w = at::empty({std::min(kSgemmRows, (N + grain - 1) / grain * grain), ldd}, x.options());
  float* base = w.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += kSgemmRows) {
    const int64_t nb = std::min(kSgemmRows, N - n0), blocks = (nb + grain - 1) / grain;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      decode(n0 + b0 * grain, n0 + std::min(b1 * grain, nb), base + b0 * grain * ldd);
    });
    out.narrow(1, n0, nb).copy_(at::mm(x, w.narrow(0, 0, nb).narrow(1, 0, x.size(1)).t()));
  }
  if (bias) out.add_(at::from_blob(const_cast<float*>(bias), {N}, x.options()));
}

}  // namespace torchqkit_cpu
