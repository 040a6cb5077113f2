// CUDA backend of the torchqkit ops: argument checks, dtype plumbing, streams. The schemas (with fake and
// reference impls) are defined in Python, torchqkit/kernels/ops/ (one module per op); this file registers CUDA kernels
// for three of them. The kernels themselves (*.cu) see no torch header, only kernels.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common/aten_glue.h"

#include <optional>
#include <vector>

#include "kernels.h"

namespace torchqkit_cuda {
namespace {

using torchqkit_glue::float_bias;
using torchqkit_glue::out_shape;

ActType act_type(const at::Tensor& x, const char* op, bool allow_float) {
  switch (x.scalar_type()) {
    case at::kHalf: return ActType::kHalf;
    case at::kBFloat16: return ActType::kBFloat16;
    case at::kFloat:
      TORCH_CHECK(allow_float, op, ": tensor cores take float16 / bfloat16 activations, got float32; cast x, "
                  "or use KernelPreference.TRITON (runs float32) or REFERENCE");
      return ActType::kFloat;
    default: TORCH_CHECK(false, op, ": activations must be float16, bfloat16 or float32, got ", x.scalar_type());
  }
}

void check_cuda(const at::Tensor& t, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
}

at::Tensor linear_int4wo_tiled(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale_and_zero,
                               int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_int4wo_tiled (CUDA)";
  const c10::cuda::CUDAGuard guard(x.device());
  const ActType t = act_type(x, op, /*allow_float=*/false);
  TORCH_CHECK(qdata.scalar_type() == at::kInt && qdata.dim() == 4 && qdata.size(2) == 32, op,
              ": qdata must be int32 [N8/8][chunks][32][T/2] tiles, got ", qdata.scalar_type(), " ", qdata.sizes());
  const int64_t n8 = qdata.size(0) * 8, kt = qdata.size(1) * 32 * qdata.size(3), K = x.size(-1);
  TORCH_CHECK(out_features <= n8 && K <= kt && K % group_size == 0 && group_size % 16 == 0, op, ": x (..., ", K,
              "), out_features ", out_features, ", group ", group_size, " don't fit tiles for (", n8, ", ", kt, ")");
  TORCH_CHECK(scale_and_zero.dim() == 3 && scale_and_zero.size(1) == n8 && scale_and_zero.size(2) == 2 &&
                  at::isFloatingType(scale_and_zero.scalar_type()), op,
              ": scale_and_zero must be float [Kt/g][N8][2], got ", scale_and_zero.scalar_type(), " ",
              scale_and_zero.sizes());
  check_cuda(qdata, x, op, "qdata");
  check_cuda(scale_and_zero, x, op, "scale_and_zero");
  // The kernel reads (scale, zero) pairs in x's dtype. Scales stored in another dtype (Int4WeightOnlyConfig's
  // scale_dtype) are rounded to it here: the same rounding the dequantized weight gets on its way into the
  // 16-bit tensor-core product, so it adds no error of a new order.
  const at::Tensor x2 = x.reshape({-1, K}).contiguous(), q = qdata.contiguous(),
                   sz = scale_and_zero.to(x.scalar_type()).contiguous();
  const int64_t M = x2.size(0), k16 = K / 16;
  // Decode: split K so that enough warps stream the weight; prefill: whole K per warp.
  const int split = M <= 16 ? static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(8, k16 / 8))) : 1;
  at::Tensor part = at::empty({split, M, out_features}, x2.options().dtype(at::kFloat));
  if (M > 0 && out_features > 0) {
    const Int4TiledArgs args{x2.data_ptr(), M, K, K, q.data_ptr<int32_t>(), q.size(1), static_cast<int>(q.size(3)),
                             out_features, n8, sz.data_ptr(), group_size, part.data_ptr<float>(), split};
    int4_tiled_mma(t, args, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor out = part.sum(0);
  const at::Tensor b = float_bias(bias, out_features, op);
  if (b.defined()) out.add_(b);
  return out.to(x.scalar_type()).reshape(out_shape(x, out_features));
}

at::Tensor linear_nf4wo(const at::Tensor& x, const at::Tensor& qdata, const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& scale_codes, const std::optional<at::Tensor>& scale_block_scale,
                        const std::optional<at::Tensor>& scale_offset, int64_t block_size,
                        const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_nf4wo (CUDA)";
  const c10::cuda::CUDAGuard guard(x.device());
  const ActType t = act_type(x, op, /*allow_float=*/true);
  TORCH_CHECK(qdata.scalar_type() == at::kByte && qdata.dim() == 2, op, ": qdata must be (N, K/2) uint8");
  const int64_t N = qdata.size(0), K = 2 * qdata.size(1);
  TORCH_CHECK(x.size(-1) == K && block_size % 2 == 0 && K % block_size == 0, op, ": x has ", x.size(-1),
              " features, weight K = ", K, ", block ", block_size);
  check_cuda(qdata, x, op, "qdata");
  const bool dq = !scale.has_value();
  TORCH_CHECK(!dq || (scale_codes && scale_block_scale && scale_offset), op,
              ": pass scale, or all of scale_codes / scale_block_scale / scale_offset (double quantization)");
  const at::Tensor absmax = dq ? at::Tensor() : scale->to(at::kFloat).contiguous();
  const at::Tensor codes = dq ? scale_codes->contiguous() : at::Tensor();
  const at::Tensor dq_scale = dq ? scale_block_scale->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor dq_offset = dq ? scale_offset->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK((dq ? codes.numel() : absmax.numel()) == N * (K / block_size), op, ": absmax must be (N, K / block)");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous(), q = qdata.contiguous(), b = float_bias(bias, N, op);
  const int64_t M = x2.size(0);
  at::Tensor out = at::empty({M, N}, x2.options());
  if (M > 0 && N > 0) {
    const Nf4Args args{x2.data_ptr(), M, K, K, q.data_ptr<uint8_t>(), N, block_size,
                       dq ? nullptr : absmax.data_ptr<float>(), dq ? codes.data_ptr<int8_t>() : nullptr,
                       dq ? dq_scale.data_ptr<float>() : nullptr, dq ? dq_offset.data_ptr<float>() : nullptr,
                       b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr(), N};
    nf4_gemv(t, args, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out.reshape(out_shape(x, N));
}

at::Tensor linear_fp8wo(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_fp8wo (CUDA)";
  const c10::cuda::CUDAGuard guard(x.device());
  const ActType t = act_type(x, op, /*allow_float=*/true);
  const auto st = qdata.scalar_type();
  TORCH_CHECK((st == at::kFloat8_e4m3fn || st == at::kFloat8_e5m2 || st == at::kFloat8_e4m3fnuz ||
               st == at::kFloat8_e5m2fnuz) && qdata.dim() == 2,
              op, ": qdata must be (N, K) float8_e4m3fn / float8_e5m2 / float8_e4m3fnuz / float8_e5m2fnuz, got ", st);
  const Fp8Kind kind = st == at::kFloat8_e5m2       ? Fp8Kind::kE5m2
                       : st == at::kFloat8_e4m3fnuz ? Fp8Kind::kE4m3fnuz
                       : st == at::kFloat8_e5m2fnuz ? Fp8Kind::kE5m2fnuz
                                                    : Fp8Kind::kE4m3fn;
  const int64_t N = qdata.size(0), K = qdata.size(1);
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " features but the weight has K = ", K);
  TORCH_CHECK(scale.dim() == 2 && N % scale.size(0) == 0 && K % scale.size(1) == 0, op,
              ": scale must be (N / bn, K / bk), got ", scale.sizes());
  check_cuda(qdata, x, op, "qdata");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous(), q = qdata.contiguous().view(at::kByte);
  const at::Tensor s = scale.to(at::kFloat).contiguous(), b = float_bias(bias, N, op);
  const int64_t M = x2.size(0);
  at::Tensor out = at::empty({M, N}, x2.options());
  if (M > 0 && N > 0) {
    const Fp8Args args{x2.data_ptr(), M, K, K, q.data_ptr<uint8_t>(), kind, N, s.data_ptr<float>(),
                       N / s.size(0), K / s.size(1), s.size(1), b.defined() ? b.data_ptr<float>() : nullptr,
                       out.data_ptr(), N};
    fp8_gemv(t, args, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out.reshape(out_shape(x, N));
}

}  // namespace
}  // namespace torchqkit_cuda

TORCH_LIBRARY_IMPL(torchqkit, CUDA, m) {
  m.impl("linear_int4wo_tiled", &torchqkit_cuda::linear_int4wo_tiled);
  m.impl("linear_nf4wo", &torchqkit_cuda::linear_nf4wo);
  m.impl("linear_fp8wo", &torchqkit_cuda::linear_fp8wo);
}
