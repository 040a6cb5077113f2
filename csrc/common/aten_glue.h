// ATen-side helpers shared by the CPU and CUDA op registrations (csrc/cpu/*_ops.cpp, registration.cpp,
// csrc/cuda/registration.cpp): argument normalisation around the kernels, no math.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace torchqkit_glue {

// Row-major with unit column stride (a narrowed view is fine); otherwise a contiguous copy.
inline at::Tensor rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// The optional bias as contiguous float32 of shape (n), or an undefined tensor.
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must have shape (", n, "), got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// x's shape (..., K) with the last dim replaced by n: a linear's output shape.
inline std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = n;
  return s;
}

}  // namespace torchqkit_glue
