// The loop of the scalar (reference-speed) CPU kernels, which run on any x86-64 CPU: every output of weight
// rows [n0, n1) for every token, out[m, n] = dot(n, m) + bias[n], where dot is the format's own sum over k.
#pragma once
#include <cstdint>

namespace torchqkit_cpu {

template <class Dot>
void scalar_linear(int64_t M, int64_t n0, int64_t n1, const float* bias, float* out, int64_t ldo, Dot dot) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) out[m * ldo + n] = dot(n, m) + (bias ? bias[n] : 0.f);
}

}  // namespace torchqkit_cpu
