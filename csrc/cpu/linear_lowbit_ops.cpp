// CPU backend of the low-bit weight-only linear ops: argument checks, scale plumbing, threads, ISA choice.
//
// torchqkit::linear_nf4wo, linear_fp8wo, linear_mxwo, linear_nvfp4wo, linear_fp6wo and linear_intxwo are defined
// (schema, fake, reference) in torchqkit/kernels/ops/ (one module per op); the kernels are in linear_lowbit.cpp.
//
// Two paths (see the opening comment of linear_lowbit.cpp):
//   M <= dot_max_m: the dot kernel, weights decoded in registers, at::parallel_for over blocks of rows.
//   larger M:      the prefill kernel, at::parallel_for over blocks of rows: each block decoded once to fp32
//                  (L2), then register-tiled FMA. (ATen's sgemm called inside at::parallel_for ran 250x
//                  slower here: nested OpenMP; so this op calls no BLAS.)
// bf16 activations on AVX512-BF16 take the bf16 kernels on both paths (run_bf16).
#include <ATen/ATen.h>
#include "parallel.h"
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "panel_activations.h"
#include "fp32_matmul_precision.h"
#include "grouped_rows.h"
#include "kernel_descriptions.h"
#include "kernels.h"
#include "route_choice.h"
#include "sgemm_prefill.h"
#include "../common/aten_glue.h"

namespace torchqkit_cpu {
namespace {

using torchqkit_glue::rows;
using torchqkit_glue::out_shape;

// Tokens up to which the dot kernel (4 per pass over the weights) beats decoding to fp32 first: nf4 and
// float8 decode cheaply, packed intx doesn't (measured with benchmarks/bench_linear.py --formats, M = 8:
// nf4 2.5 vs 4.6 ms, int3 6.3 vs 4.7 ms at 4096 x 4096).
// FP6 keeps intx's bound.
int64_t dot_max_m(LowbitFormat fmt) {
  return fmt == LowbitFormat::kIntx || fmt == LowbitFormat::kFp6E3m2 || fmt == LowbitFormat::kFp6E2m3 ? 4 : 8;
}
constexpr int64_t kDotBlockRows = 16;
constexpr int64_t kPrefillBlockRows = 64;  // rows per parallel task (decoded 32 at a time, linear_lowbit.cpp)
// Below AVX-512 the register-tiled prefill kernel ran at 0.5-0.6x fp32 F.linear (AVX2, 4096^2, M = 256); from
// kSgemmMinM tokens on, rows are dequantized by linear_lowbit_decode for ATen's sgemm (prefill_dequantized):
// 0.9-1.3x at M = 256. Not from 16 as int4: at M = 16-64 that path measured anywhere from 0.4x to 1.0x fp32 from
// run to run (the decode's parallel region handing over to sgemm's threads), the prefill kernel a steady 0.6-1.2x.
constexpr int64_t kSgemmMinM = 128;
// With the 256-bit panels as the GEMM (Note [fp32 panels at 256 bits]) the dequantized route runs from the first M past
// the dot kernel: it beat the prefill kernel at every M timed (AVX2, Zen 5, 2 threads, nf4 / int3 ms, 4096^2: M = 8
// int3 3.19 -> 2.83, M = 16 4.73 -> 3.85 / 4.70 -> 3.69, M = 64 16.4 -> 11.0; 576 x 1536, M = 16 0.24 -> 0.21).
// Whether M tokens past the dot kernel take rows dequantized for a GEMM (which one: *sgemm) rather than the prefill
// kernel. The route is measured per case where both can serve (Note [Routes chosen by measurement]); unmeasured, the
// AVX-512 level takes sgemm on Intel CPUs from kSgemmMinM, the AVX2 level the 256-bit panels elsewhere.
bool dequantized_prefill(Isa isa, int64_t M, bool* sgemm) {
  const bool intel = fp32_prefill_rule_sgemm();
  if (isa == Isa::kAvx512Vnni) return *sgemm = fp32_prefill_takes_sgemm(isa, intel && M >= kSgemmMinM);
  *sgemm = fp32_prefill_takes_sgemm(isa, intel);  // always sgemm at the scalar level
  return !*sgemm || M >= kSgemmMinM;
}

void check_x(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": x has ", x.size(-1), " features but the weight has K = ", k);
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": activations must be float32, bfloat16 or float16, got ", dt);
}

// (N / bn, G) fp32 contiguous, with bn and g = K / G checked.
at::Tensor block_scales(const at::Tensor& s, int64_t n, int64_t k, const char* what, const char* op) {
  TORCH_CHECK(s.dim() == 2 && s.size(0) >= 1 && s.size(1) >= 1 && n % s.size(0) == 0 && k % s.size(1) == 0, op,
              ": ", what, " must be 2-d (N / bn, K / bk) dividing (N, K) = (", n, ", ", k, "), got ", s.sizes());
  return s.to(at::kFloat).contiguous();
}

// Groups the AVX512-BF16 kernels take: whole decode steps of 32 weights, or one group per row (the rest, e.g.
// nf4 block_size 16 or intx PerGroup(24), run the fp32 kernels on the activations converted to fp32; status says so).
bool bf16_groups(const LowbitArgs& p) { return p.G == 1 || p.g % 32 == 0; }

// Whether a call runs the AVX512-BF16 kernels (linear_lowbit_bf16.h) rather than the fp32 ones.
//   bf16 activations, prefill M (above dot_max_m): always (2.1-2.3x fp32 F.linear at M = 256, 4096^2, 1 thread,
//     where the fp32 kernels reach 1.0-1.2x).
//   bf16 activations, decode M: where the bf16 dot kernel beats converting x to fp32 for the fp32 one
//     (bf16_dot_wins).
//   float32 activations: from the prefill M on when torch allows bf16 matmuls (Note [fp32 activations in bf16]).
// Groups must be whole 32-k steps (bf16_groups); float16 activations always run the fp32 kernels.
//
// bf16_dot_wins: the bf16 dot kernel's CPU time over that of converting x to fp32 for the fp32 dot kernel, 4096^2,
// 1 thread, weights from a 200 MiB ring (python benchmarks/bench_bf16_decode.py --threads 1 --cpu-time, Zen 4):
//            M = 1   2     4     8
//   nf4      1.14  0.71  0.58  0.66     4-bit codebooks: the fp32 kernel at M = 1, bf16 from M = 2
//   mxfp4    1.62  0.78  0.65  0.67
//   fp8      1.60  1.36  1.45  1.31     float8 (MXFP8 too, the same decoder): the fp32 kernel at every decode M
//   int3     1.21  1.04  0.69  (prefill) packed intx: bf16 from M = 4 (its last dot M), the fp32 kernel below
bool bf16_dot_wins(LowbitFormat fmt, int64_t M) {
  switch (fmt) {
    case LowbitFormat::kNf4:
    case LowbitFormat::kFp4E2m1: return M >= 2;
    case LowbitFormat::kIntx: return M >= 4;
    default: return false;  // float8 (e4m3 / e5m2, fnuz too)
  }
}

// Float32 activations of a prefill as three bf16 planes on AMX: not for nf4, whose levels the panels round to bf16
// (Note [nf4 levels in bf16]): the planes would keep x's precision and lose the weight's.
bool fp32_planes(at::ScalarType dt, const LowbitArgs& p) {
  return p.fmt != LowbitFormat::kNf4 && fp32_takes_amx_planes(dt);
}

bool takes_bf16(Isa level, at::ScalarType dt, const LowbitArgs& p, int64_t M) {
  if (level != Isa::kAvx512Bf16 || !bf16_groups(p)) return false;
  const bool prefill = M > dot_max_m(p.fmt);
  if (dt == at::kBFloat16) return prefill || bf16_dot_wins(p.fmt, M);
  return dt == at::kFloat && prefill && (fp32_matmul_allows_bf16() || fp32_planes(dt, p));
}


// The AVX512-BF16 kernels (linear_lowbit_bf16.h): x as bf16 (padded with zero columns to whole steps), the dot
// kernel up to dot_max_m tokens, bf16 panels + vdpbf16ps tiles above. Zero points (offset): the panels add
// sum_g xsum[m, g] * offset[n, g] per 32-row panel (fp32 FMAs); after the dot kernels it is one (M, G) x (G, N)
// matmul here, instead of a second pass in every tile.
// planes: 3 for float32 activations on AMX (fp32_planes, prefill only), else 1.
void run_bf16(const at::Tensor& x2, LowbitArgs p, int64_t K32, at::Tensor& out, int planes) {
  const int64_t N = p.N, M = x2.size(0);
  const bool dot = M <= dot_max_m(p.fmt);
  const int64_t rows = dot ? kDotBlockRows : balanced_rows(N, kPrefillBlockRows, 32);
  const Bf16Activations a = bf16_activations(x2, K32, planes, !dot && amx_selected());
  const at::Tensor& xp = a.data;  // (M, K32) below the prefill
  const float* offset = p.offset;
  at::Tensor xsum;
  if (offset) xsum = group_sums(x2, planes, p.G, p.g);
  if (dot) p.offset = nullptr;
  else p.xsum = offset ? xsum.data_ptr<float>() : nullptr;
  p.x = nullptr;
  p.xb = a.ptr();
  p.xb_planes = a.planes;
  p.ldx = K32;
  at::Tensor xdot;
  int64_t perm[32];
  if (dot && lowbit_bf16_dot_order(p, perm)) {  // x in the decoder's dot order, step by step
    xdot = xp.view({M, K32 / 32, 32}).index_select(2, at::from_blob(perm, {32}, at::kLong));
    p.xb = reinterpret_cast<const uint16_t*>(xdot.data_ptr());
  }
  at::parallel_for(0, (N + rows - 1) / rows, 1, [&](int64_t b0, int64_t b1) {
    if (dot) linear_lowbit_dot(Isa::kAvx512Bf16, p, b0 * rows, std::min(b1 * rows, N));
    else linear_lowbit_prefill(Isa::kAvx512Bf16, p, b0 * rows, std::min(b1 * rows, N));
  });
  if (offset && dot) {
    const at::Tensor off = at::from_blob(const_cast<float*>(offset), {N / p.bn, p.G}, out.options());
    out.addmm_(xsum, off.repeat_interleave(p.bn, 0).t());
  }
}

// Fills the activation / output / bias fields of p, runs the kernels, returns (..., N) in x.dtype.
at::Tensor run_kernels(const at::Tensor& x, LowbitArgs p, const std::optional<at::Tensor>& bias, const char* op) {
  // x padded with zero columns to whole decode steps of 32 (Note [Low-bit decode steps] in linear_lowbit_isa.h)
  const int64_t N = p.N, K = p.K, K32 = (K + 31) / 32 * 32;
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape (", N, "), got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  // AVX-VNNI (Intel's client CPUs) runs the AVX2 kernels: these ops have no integer dot products to give it.
  const Isa level = selected_isa_exact(), isa = base_isa(level);
  at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  const bool bf16 = takes_bf16(level, x.scalar_type(), p, M);
  if (!bf16) x2 = x2.to(at::kFloat);
  at::Tensor out = at::empty({M, N}, x2.options().dtype(at::kFloat));
  if (M > 0 && N > 0) {
    p.M = M;
    p.bias = b.defined() ? b.data_ptr<float>() : nullptr;
    p.out = out.data_ptr<float>();
    p.ldo = N;
    if (bf16) {
      run_bf16(x2, p, K32, out, fp32_planes(x.scalar_type(), p) ? 3 : 1);
      return out.to(x.scalar_type()).reshape(out_shape(x, N));
    }
    at::Tensor xp = K32 == K ? x2.contiguous() : at::constant_pad_nd(x2, {0, K32 - K}, 0);
    p.x = xp.data_ptr<float>();
    p.ldx = K32;
    if (M <= dot_max_m(p.fmt)) {
      at::parallel_for(0, (N + kDotBlockRows - 1) / kDotBlockRows, 1, [&](int64_t b0, int64_t b1) {
        linear_lowbit_dot(isa, p, b0 * kDotBlockRows, std::min(b1 * kDotBlockRows, N));
      });
    } else if (bool sgemm; dequantized_prefill(isa, M, &sgemm)) {
      prefill_dequantized(sgemm, xp, N, K32, kDotBlockRows, p.bias, out, [&](int64_t r0, int64_t r1, float* dst) {
        linear_lowbit_decode(isa, p, r0, r1, dst, K32);
      });
    } else {
      const int64_t rows = balanced_rows(N, kPrefillBlockRows, 32);
      at::parallel_for(0, (N + rows - 1) / rows, 1, [&](int64_t b0, int64_t b1) {
        linear_lowbit_prefill(isa, p, b0 * rows, std::min(b1 * rows, N));
      });
    }
  }
  return out.to(x.scalar_type()).reshape(out_shape(x, N));
}

// Note [Activation rows past the decoders' range]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The kernels multiply each activation by a decoded code before the block scale: e5m2 codes decode to their values
// (up to 57344), e4m3 codes to value / 256, integer codes to up to 127. So an activation row near float32's largest
// value overflows a product that the reference, x times the small dequantized weight, keeps finite (a float8
// activation config hands these kernels x fake-quantized, up to float32's largest value). A row whose largest finite
// |x| reaches 2^64 (no model's activation comes near) runs divided by a power of two, exactly, and its output row is
// multiplied back; the scan for such rows reads x's bits once, a fraction of a microsecond for one token.
constexpr uint32_t kHugeFloatBits = 0x5F800000u;  // 2^64 as float32 bits (|x| bits at or above: huge or non-finite)
constexpr uint16_t kHugeBf16Bits = 0x5F80u;

bool may_have_huge_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kHalf) return false;  // float16 stops at 65504
  if (!x.is_contiguous()) return may_have_huge_rows(x.contiguous());
  const int64_t n = x.numel();
  if (x.scalar_type() == at::kFloat) {
    const uint32_t* b = static_cast<const uint32_t*>(x.const_data_ptr());
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, b[i] & 0x7fffffffu);
    return m >= kHugeFloatBits;
  }
  const uint16_t* b = static_cast<const uint16_t*>(x.const_data_ptr());
  uint16_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max<uint16_t>(m, b[i] & 0x7fffu);
  return m >= kHugeBf16Bits;
}

at::Tensor run(const at::Tensor& x, const LowbitArgs& p, const std::optional<at::Tensor>& bias, const char* op);

// The rows of x whose largest finite |x| reaches 2^64, divided by 2^e (e: that value's exponent) and the output rows
// multiplied by 2^e (Note [Activation rows past the decoders' range]); nullopt when x has no such row.
std::optional<at::Tensor> run_rescaled(const at::Tensor& x, const LowbitArgs& p, const std::optional<at::Tensor>& bias,
                                       const char* op) {
  const int64_t K = p.K, N = p.N;
  at::Tensor x2 = x.reshape({-1, K}).to(at::kFloat).contiguous().clone();
  const int64_t M = x2.size(0);
  std::vector<int> e(M, 0);
  bool any = false;
  float* xp = x2.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k)
      if (std::isfinite(xp[r * K + k])) amax = std::max(amax, std::fabs(xp[r * K + k]));
    if (amax < 18446744073709551616.f) continue;  // 2^64
    std::frexp(amax, &e[r]);
    for (int64_t k = 0; k < K; ++k) xp[r * K + k] = std::ldexp(xp[r * K + k], -e[r]);
    any = true;
  }
  if (!any) return std::nullopt;
  at::Tensor out = run(x2, p, std::nullopt, op);  // (M, N) float32: no row is huge now
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    if (e[r])
      for (int64_t j = 0; j < N; ++j) o[r * N + j] = std::ldexp(o[r * N + j], e[r]);
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type()).reshape(out_shape(x, N));
}

// run_kernels under the routes measured for the case (Note [Routes chosen by measurement]).
at::Tensor run(const at::Tensor& x, const LowbitArgs& p, const std::optional<at::Tensor>& bias, const char* op) {
  if (p.K > 0 && x.size(-1) == p.K && may_have_huge_rows(x)) {
    if (std::optional<at::Tensor> out = run_rescaled(x, p, bias, op)) return *out;
  }
  const int64_t M = p.K > 0 && x.size(-1) == p.K ? x.numel() / p.K : 0;
  // keyed by the level whose kernels run: AVX-VNNI shares the AVX2 level's measured routes
  const RouteCase c{op, (int)base_isa(selected_isa_exact()), (int)x.scalar_type(), M, p.N, p.K,
                    (int)p.fmt * 1024 + p.g};
  return measured_routes(c, [&] { return run_kernels(x, p, bias, op); });
}

LowbitArgs weight_args(const at::Tensor& w, LowbitFormat fmt, int64_t N, int64_t K) {
  LowbitArgs p{};
  p.fmt = fmt;
  p.w = reinterpret_cast<const uint8_t*>(w.data_ptr());
  p.N = N;
  p.K = K;
  p.ldw = w.stride(0);
  return p;
}

at::Tensor linear_nf4wo(const at::Tensor& x, const at::Tensor& qdata, const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& scale_codes, const std::optional<at::Tensor>& scale_block_scale,
                        const std::optional<at::Tensor>& scale_offset, int64_t block_size,
                        const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_nf4wo";
  TORCH_CHECK(qdata.dim() == 2 && qdata.scalar_type() == at::kByte, op,
              ": qdata must be (N, K / 2) uint8, got ", qdata.scalar_type(), " of shape ", qdata.sizes());
  const int64_t N = qdata.size(0), K = 2 * qdata.size(1);
  check_x(x, K, op);
  TORCH_CHECK(block_size >= 2 && block_size % 2 == 0 && K % block_size == 0, op, ": block_size ", block_size,
              " must be even and divide K = ", K);
  const int64_t G = K / block_size;
  const at::Tensor w = rows(qdata);
  LowbitArgs p = weight_args(w, LowbitFormat::kNf4, N, K);
  p.G = G;
  p.g = block_size;
  p.bn = 1;
  at::Tensor s, codes, bs;
  if (scale.has_value()) {
    TORCH_CHECK(!scale_codes.has_value(), op, ": pass either scale or the double-quantized scale_* tensors");
    TORCH_CHECK(scale->dim() == 2 && scale->size(0) == N && scale->size(1) == G, op, ": scale must be (N, K / B) = (",
                N, ", ", G, "), got ", scale->sizes());
    s = scale->to(at::kFloat).contiguous();
    p.scale = s.data_ptr<float>();
  } else {
    TORCH_CHECK(scale_codes.has_value() && scale_block_scale.has_value() && scale_offset.has_value(), op,
                ": without scale, scale_codes, scale_block_scale and scale_offset are all required");
    TORCH_CHECK(scale_codes->scalar_type() == at::kChar && scale_codes->numel() == N * G, op,
                ": scale_codes must be (N, K / B) int8, got ", scale_codes->scalar_type(), " ", scale_codes->sizes());
    TORCH_CHECK(scale_block_scale->numel() * 256 >= N * G && scale_offset->numel() == 1, op,
                ": scale_block_scale needs ceil(N * K / B / 256) values and scale_offset one");
    codes = scale_codes->contiguous();
    bs = scale_block_scale->to(at::kFloat).contiguous();
    p.dq_codes = codes.data_ptr<int8_t>();
    p.dq_scale = bs.data_ptr<float>();
    p.dq_offset = scale_offset->to(at::kFloat).item<float>();
  }
  return run(x, p, bias, op);
}

bool is_float8(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kFloat8_e4m3fnuz || t == at::kFloat8_e5m2fnuz;
}

// Float8 bytes: the e4m3 decoder yields value / 256 (exact), scale_mul puts the 256 back; e4m3fnuz's value / 128
// (Note [float8 fnuz bytes] in linear_lowbit_isa.h).
LowbitArgs fp8_weight_args(const at::Tensor& w, at::ScalarType qt, int64_t N, int64_t K) {
  const LowbitFormat fmt = qt == at::kFloat8_e4m3fn     ? LowbitFormat::kFloat8E4m3
                           : qt == at::kFloat8_e4m3fnuz ? LowbitFormat::kFloat8E4m3Fnuz
                           : qt == at::kFloat8_e5m2fnuz ? LowbitFormat::kFloat8E5m2Fnuz
                                                        : LowbitFormat::kFloat8E5m2;
  LowbitArgs p = weight_args(w, fmt, N, K);
  p.scale_mul = fmt == LowbitFormat::kFloat8E4m3 ? 256.f : fmt == LowbitFormat::kFloat8E4m3Fnuz ? 128.f : 1.f;
  return p;
}

at::Tensor linear_fp8wo(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_fp8wo";
  const auto qt = qdata.scalar_type();
  TORCH_CHECK(qdata.dim() == 2 && is_float8(qt), op,
              ": qdata must be (N, K) float8_e4m3fn, float8_e5m2, float8_e4m3fnuz or float8_e5m2fnuz, got ", qt,
              " of shape ", qdata.sizes());
  const int64_t N = qdata.size(0), K = qdata.size(1);
  check_x(x, K, op);
  const at::Tensor w = rows(qdata);
  const at::Tensor s = block_scales(scale, N, K, "scale", op);
  LowbitArgs p = fp8_weight_args(w, qt, N, K);
  p.scale = s.data_ptr<float>();
  p.G = s.size(1);
  p.g = K / p.G;
  p.bn = N / s.size(0);
  return run(x, p, bias, op);
}

// MXLayout bytes (torchqkit/layouts/mx.py): MXFP8 runs the float8 decoders and MXFP4 the fp4 e2m1 one, both
// reading the E8M0 exponents (one per 32 k) as stored.
at::Tensor linear_mxwo(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_mxwo";
  const auto qt = qdata.scalar_type();
  TORCH_CHECK(qdata.dim() == 2 && (qt == at::kByte || qt == at::kFloat8_e4m3fn || qt == at::kFloat8_e5m2), op,
              ": qdata must be (N, K / 2) uint8 (MXFP4) or (N, K) float8 (MXFP8), got ", qt, " of shape ",
              qdata.sizes());
  const int64_t N = qdata.size(0), K = qt == at::kByte ? 2 * qdata.size(1) : qdata.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kByte && scale.size(0) == N && scale.size(1) * 32 == K,
              op, ": scale must be (N, K / 32) = (", N, ", ", K / 32, ") uint8 E8M0 exponents, got ",
              scale.scalar_type(), " ", scale.sizes());
  check_x(x, K, op);
  const at::Tensor w = rows(qdata), e = scale.contiguous();
  LowbitArgs p = qt == at::kByte ? weight_args(w, LowbitFormat::kFp4E2m1, N, K) : fp8_weight_args(w, qt, N, K);
  p.scale_e8m0 = e.data_ptr<uint8_t>();  // decoded per group by the kernels (scale_at)
  p.G = K / 32;
  p.g = 32;
  p.bn = 1;
  return run(x, p, bias, op);
}

// NVFP4Layout bytes (torchqkit/layouts/nvfp4.py): the e2m1 decoder of MXFP4 with float8 e4m3 scales per 16 k. A
// block scale is its byte's value divided by the global scale (the reference's float32 division, so bit for bit its
// scales): the kernels divide the decoded bytes with vector ops (e4m3_quotients in linear_lowbit_isa.h), the dot
// kernel the 256 possible bytes once per call and then looks each block's byte up, the fp32 blocks a block of rows'
// scale bytes at a time. Groups of 16 are half a decode step of 32: the dot kernel scales each half (Note [Groups of
// half a step] in linear_lowbit_isa.h).
at::Tensor linear_nvfp4wo(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                          const at::Tensor& global_scale, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_nvfp4wo";
  TORCH_CHECK(qdata.dim() == 2 && qdata.scalar_type() == at::kByte, op,
              ": qdata must be (N, K / 2) uint8, got ", qdata.scalar_type(), " of shape ", qdata.sizes());
  const int64_t N = qdata.size(0), K = 2 * qdata.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat8_e4m3fn && scale.size(0) == N &&
                  scale.size(1) * 16 == K, op, ": scale must be (N, K / 16) = (", N, ", ", K / 16,
              ") float8_e4m3fn, got ", scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK(global_scale.numel() == 1 && global_scale.is_floating_point(), op,
              ": global_scale must hold one float, got ", global_scale.scalar_type(), " ", global_scale.sizes());
  check_x(x, K, op);
  const at::Tensor w = rows(qdata), e = scale.contiguous();
  LowbitArgs p = weight_args(w, LowbitFormat::kFp4E2m1, N, K);
  p.scale_e4m3 = reinterpret_cast<const uint8_t*>(e.data_ptr());
  p.e4m3_global = global_scale.to(at::kFloat).reshape({}).cpu().item<float>();
  p.G = K / 16;
  p.g = 16;
  p.bn = 1;
  return run(x, p, bias, op);
}

// FP6Layout bytes (torchqkit/layouts/fp6.py): 6-bit fields as packed intx stores them, decoded by a table of bf16
// values (AVX-512) or through fp16 (AVX2) (Note [FP6 codes to bf16 by vpermi2w], [FP6 through fp16] in
// linear_lowbit_isa.h).
at::Tensor linear_fp6wo(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale, int64_t ebits,
                        const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_fp6wo";
  TORCH_CHECK(ebits == 2 || ebits == 3, op, ": ebits must be 3 (e3m2) or 2 (e2m3), got ", ebits);
  const int64_t N = qdata.size(0), K = x.size(-1);
  TORCH_CHECK(qdata.dim() == 2 && qdata.scalar_type() == at::kByte && qdata.size(1) == (K * 6 + 7) / 8, op,
              ": qdata must be (N, ceil(K * 6 / 8)) = (N, ", (K * 6 + 7) / 8, ") uint8, got ", qdata.scalar_type(),
              " of shape ", qdata.sizes());
  check_x(x, K, op);
  const at::Tensor s = block_scales(scale, N, K, "scale", op);
  TORCH_CHECK(s.size(0) == N, op, ": scale must have one row per weight row (N = ", N, "), got ", scale.sizes());
  const at::Tensor w = rows(qdata);
  LowbitArgs p = weight_args(w, ebits == 3 ? LowbitFormat::kFp6E3m2 : LowbitFormat::kFp6E2m3, N, K);
  p.bits = 6;
  p.code_offset = 0;
  p.scale = s.data_ptr<float>();
  p.G = s.size(1);
  p.g = K / p.G;
  p.bn = 1;
  return run(x, p, bias, op);
}

at::Tensor linear_intxwo(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                         const std::optional<at::Tensor>& zero_point, int64_t bits, bool is_signed,
                         c10::string_view zero_point_domain, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_intxwo";
  TORCH_CHECK(bits >= 1 && bits <= 7, op, ": bits must be 1..7, got ", bits);
  const int64_t N = qdata.size(0), K = x.size(-1);
  TORCH_CHECK(qdata.dim() == 2 && qdata.scalar_type() == at::kByte && qdata.size(1) == (K * bits + 7) / 8, op,
              ": qdata must be (N, ceil(K * bits / 8)) = (N, ", (K * bits + 7) / 8, ") uint8, got ",
              qdata.scalar_type(), " of shape ", qdata.sizes());
  check_x(x, K, op);
  const std::string zpd(zero_point_domain);
  TORCH_CHECK(zpd == "none" || zpd == "int" || zpd == "float", op, ": zero_point_domain must be none, int or float");
  TORCH_CHECK((zpd == "none") != zero_point.has_value(), op, ": zero_point_domain=", zpd, " but zero_point is ",
              zero_point.has_value() ? "given" : "missing");
  const at::Tensor s = block_scales(scale, N, K, "scale", op);
  const int64_t qmin = is_signed ? -(int64_t(1) << (bits - 1)) : 0, qmax = qmin + (int64_t(1) << bits) - 1;
  // w = (u + qmin) * s [- z * s | + z - mid * s]  ==  (u + code_offset) * s + offset  (u: the stored unsigned
  // field). The integer parts go into code_offset (exact, decoded in integers); offset keeps only the zero point.
  int64_t code_offset = qmin;
  at::Tensor off;
  if (zpd != "none") {
    TORCH_CHECK(zero_point->sizes() == scale.sizes(), op, ": zero_point must have the scale's shape ", scale.sizes());
    const at::Tensor z = zero_point->to(at::kFloat);
    const int64_t mid = (qmin + qmax + 1) / 2;  // the oracle's code_midpoint (qmin + qmax + 1 >= 0 here)
    if (zpd == "float") code_offset = qmin - mid;
    off = (zpd == "int" ? -z * s : z).contiguous();
  }
  const at::Tensor w = rows(qdata);
  LowbitArgs p = weight_args(w, LowbitFormat::kIntx, N, K);
  p.bits = (int)bits;
  p.code_offset = (int)code_offset;
  p.scale = s.data_ptr<float>();
  p.offset = off.defined() ? off.data_ptr<float>() : nullptr;
  p.G = s.size(1);
  p.g = K / p.G;
  p.bn = N / s.size(0);
  return run(x, p, bias, op);
}

// What kernels.status() says serves these ops at each level (Note [Kernel descriptions] in kernel_descriptions.cpp):
// one description, as the four formats share their kernels (the opening comment of linear_lowbit.cpp).
OpDescription lowbit_description(const char* op, const char* fp32_in_bf16_from, const char* fp32_planes_from) {
  return OpDescription(op)
      .at("avx512_vnni",
          "M <= 8 (nf4, mxfp4, float8) / 4 (intx): 16 weights per zmm decoded in registers (4 rows x 4 tokens); up to "
          "M = 63: 32 x 1024 blocks decoded to fp32 (L2), then 4x4 dot tiles; M >= 64: 32-row k-major panels + 6x32 "
          "FMA tiles, except from M = 128 on Intel CPUs: blocks of 512 rows decoded to fp32, then ATen's fp32 GEMM (" +
              kFp32PrefillSgemm + ")")
      .at("avx512_bf16",
          "bf16 activations: levels decoded to bf16 (exact; nf4 levels rounded to bf16, Note [nf4 levels in bf16]) "
          "and multiplied by vdpbf16ps with fp32 sums. Decode M (<= 8; intx <= 4): 32 weights per vdpbf16ps in "
          "registers (tiles of up to 4 tokens) for nf4 / mxfp4 from M = 2 and intx at M = 4, where it is faster; "
          "float8 / mxfp8 at every decode M, nf4 / mxfp4 at M = 1 and intx below 4 convert x to fp32 for the "
          "avx512_vnni dot kernel (faster there: bf16_dot_wins in csrc/cpu/linear_lowbit_ops.cpp). Larger M: 32-row "
          "bf16 k-pair panels + 6x32 vdpbf16ps tiles. Groups of a size not a multiple of 32 and float16 activations "
          "run the avx512_vnni kernels (fp32)")
      .at("avx2",
          "8-lane decoders (AVX2 + FMA + F16C): in registers for M <= 8 (nf4, mxfp4, float8) / 4 (intx); larger M: "
          "rows decoded to fp32 16 at a time into k-major panels + 6x16 FMA tiles, on Intel CPUs fp32 blocks + dot "
          "tiles and from M = 128 blocks of 512 rows decoded to fp32, then ATen's fp32 GEMM (" +
              kFp32PrefillPanels256 + ")")
      .at("scalar", "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it")
      .fp32_in_bf16(fp32_in_bf16_from, fp32_planes_from)
      .fp32_prefill_routes();
}

// nf4 never takes the three planes at the amx level (Note [fp32 activations on AMX] in amx_bf16_gemm.h).
const DescribeOp kNf4Described(lowbit_description("torchqkit::linear_nf4wo", "M > 8", ""));
const DescribeOp kFp8Described(lowbit_description("torchqkit::linear_fp8wo", "M > 8", "M > 8"));
const DescribeOp kIntxDescribed(lowbit_description("torchqkit::linear_intxwo", "M > 4", "M > 4"));
const DescribeOp kMxDescribed(lowbit_description("torchqkit::linear_mxwo", "M > 8", "M > 8"));
// FP6: codes looked up as bf16 (Note [FP6 codes to bf16 by vpermi2w]) or turned into fp16 bits (Note [FP6 through
// fp16]), intx's M bounds.
const DescribeOp kFp6Described(
    OpDescription("torchqkit::linear_fp6wo")
        .at("avx512_vnni",
            "M <= 4: 32 weights per step decoded in registers (6-bit codes cut into 16-bit lanes and looked up as "
            "bf16 values by vpermi2w, Note [FP6 codes to bf16 by vpermi2w]), 4 rows x 4 tokens, scales once per "
            "group; larger M: 32 x 1024 blocks decoded to fp32 (L2) then 4x4 dot tiles; "
            "M >= 64: 32-row k-major panels + 6x32 FMA tiles, except from M = 128 on Intel CPUs: blocks of 512 rows "
            "decoded to fp32, then ATen's fp32 GEMM (" + kFp32PrefillSgemm + ")")
        .at("avx512_bf16",
            "bf16 activations above M = 4: FP6 values decoded to bf16 (exact: at most 4 significant bits) in 32-row "
            "k-pair panels + 6x32 vdpbf16ps tiles; decode M, groups of a size not a multiple of 32 and float16 "
            "activations run the avx512_vnni kernels (fp32)")
        .at("avx2",
            "8-lane decoders: in registers for M <= 4 (codes cut into 16-bit lanes, their sign, exponent and "
            "mantissa placed as fp16 bits and converted, Note [FP6 through fp16]); larger M: rows decoded to fp32 16 "
            "at a time into k-major panels + 6x16 FMA tiles, on Intel CPUs fp32 blocks + dot tiles and from M = 128 "
            "blocks of 512 rows decoded to fp32, then ATen's fp32 GEMM (" + kFp32PrefillPanels256 + ")")
        .at("scalar", "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it")
        .fp32_in_bf16("M > 4", "M > 4")
        .fp32_prefill_routes());
// NVFP4's groups of 16 are half a decode step (Note [Groups of half a step]); no bf16 kernel takes them.
const DescribeOp kNvfp4Described(
    OpDescription("torchqkit::linear_nvfp4wo")
        .at("avx512_vnni",
            "M <= 8: 16 weights per zmm decoded in registers (4 rows x 4 tokens), the lanes of each half of a "
            "32-weight step scaled by its block's float8 scale over the global scale (looked up per block in the 256 "
            "quotients, Note [Groups of half a step]); larger M: 32 x 1024 blocks decoded to fp32 (L2) then 4x4 dot "
            "tiles; M >= 64: 32-row k-major panels + 6x32 FMA tiles, except from M = 128 on Intel CPUs: blocks of "
            "512 rows decoded to fp32, then ATen's fp32 GEMM (" +
                kFp32PrefillSgemm + ")")
        .at("avx2",
            "8-lane decoders: in registers for M <= 8 (each half step's vectors scaled by its block's scale); larger "
            "M: rows decoded to fp32 16 at a time into k-major panels + 6x16 FMA tiles, on Intel CPUs fp32 blocks + "
            "dot tiles and from M = 128 blocks of 512 rows decoded to fp32, then ATen's fp32 GEMM (" +
                kFp32PrefillPanels256 + ")")
        .at("scalar", "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it")
        .fp32_prefill_routes());

// Stacks of experts (E, ...) of these formats: rows [offs[g - 1], offs[g]) of x through expert g (Note [Grouped
// linear in C++], grouped_rows.h). Every tensor of a stack has the experts on dim 0.
std::optional<at::Tensor> expert_of(const std::optional<at::Tensor>& t, int64_t g) {
  return t.has_value() ? std::optional<at::Tensor>(t->select(0, g)) : std::nullopt;
}

// A stack whose format is a (qdata (E, N, ...), scale (E, ...)) pair and more: expert(rows, qdata[g], scale[g], g)
// runs expert g's 2-d op.
template <class Expert>
at::Tensor grouped_qdata_scale(const char* op, const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                               const at::Tensor& scale, const Expert& expert) {
  TORCH_CHECK(qdata.dim() == 3 && scale.dim() >= 1 && qdata.size(0) == scale.size(0), op, ": qdata (E, ...) of 3 "
              "dims and scale (E, ...) of the same E experts, got ", qdata.sizes(), " and ", scale.sizes());
  return grouped_rows(op, x, offs, qdata.size(0), qdata.size(1), [&](const at::Tensor& rows, int64_t g) {
    return expert(rows, qdata.select(0, g), scale.select(0, g), g);
  });
}

at::Tensor grouped_linear_mxwo(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                               const at::Tensor& scale) {
  return grouped_qdata_scale("torchqkit::grouped_linear_mxwo", x, offs, qdata, scale,
                             [](const at::Tensor& rows, const at::Tensor& q, const at::Tensor& s, int64_t) {
                               return linear_mxwo(rows, q, s, {});
                             });
}

at::Tensor grouped_linear_fp8wo(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                const at::Tensor& scale) {
  return grouped_qdata_scale("torchqkit::grouped_linear_fp8wo", x, offs, qdata, scale,
                             [](const at::Tensor& rows, const at::Tensor& q, const at::Tensor& s, int64_t) {
                               return linear_fp8wo(rows, q, s, {});
                             });
}

at::Tensor grouped_linear_nf4wo(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& scale_codes,
                                const std::optional<at::Tensor>& scale_block_scale,
                                const std::optional<at::Tensor>& scale_offset, int64_t block_size) {
  constexpr const char* op = "torchqkit::grouped_linear_nf4wo";
  TORCH_CHECK(qdata.dim() == 3, op, ": qdata must be (E, N, K / 2) nibble pairs, got ", qdata.sizes());
  return grouped_rows(op, x, offs, qdata.size(0), qdata.size(1), [&](const at::Tensor& rows, int64_t g) {
    return linear_nf4wo(rows, qdata.select(0, g), expert_of(scale, g), expert_of(scale_codes, g),
                        expert_of(scale_block_scale, g), expert_of(scale_offset, g), block_size, {});
  });
}

at::Tensor grouped_linear_intxwo(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                 const at::Tensor& scale, const std::optional<at::Tensor>& zero_point, int64_t bits,
                                 bool is_signed, c10::string_view zero_point_domain) {
  return grouped_qdata_scale("torchqkit::grouped_linear_intxwo", x, offs, qdata, scale,
                             [&](const at::Tensor& rows, const at::Tensor& q, const at::Tensor& s, int64_t g) {
                               return linear_intxwo(rows, q, s, expert_of(zero_point, g), bits, is_signed,
                                                    zero_point_domain, {});
                             });
}

at::Tensor grouped_linear_nvfp4wo(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                  const at::Tensor& scale, const at::Tensor& global_scale) {
  constexpr const char* op = "torchqkit::grouped_linear_nvfp4wo";
  // (a qdata of other dims: grouped_qdata_scale names that first)
  TORCH_CHECK(qdata.dim() != 3 || (global_scale.dim() >= 1 && global_scale.size(0) == qdata.size(0)), op,
              ": global_scale must hold one scale per expert (E, ...), got ", global_scale.sizes());
  return grouped_qdata_scale(op, x, offs, qdata, scale,
                             [&](const at::Tensor& rows, const at::Tensor& q, const at::Tensor& s, int64_t g) {
                               return linear_nvfp4wo(rows, q, s, global_scale.select(0, g), {});
                             });
}

at::Tensor grouped_linear_fp6wo(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                const at::Tensor& scale, int64_t ebits) {
  return grouped_qdata_scale("torchqkit::grouped_linear_fp6wo", x, offs, qdata, scale,
                             [&](const at::Tensor& rows, const at::Tensor& q, const at::Tensor& s, int64_t) {
                               return linear_fp6wo(rows, q, s, ebits, {});
                             });
}

const DescribeOp kGroupedNvfp4Described(
    grouped_description("torchqkit::grouped_linear_nvfp4wo", "torchqkit::linear_nvfp4wo"));
const DescribeOp kGroupedFp6Described(
    grouped_description("torchqkit::grouped_linear_fp6wo", "torchqkit::linear_fp6wo"));
const DescribeOp kGroupedMxDescribed(grouped_description("torchqkit::grouped_linear_mxwo", "torchqkit::linear_mxwo"));
const DescribeOp kGroupedFp8Described(
    grouped_description("torchqkit::grouped_linear_fp8wo", "torchqkit::linear_fp8wo"));
const DescribeOp kGroupedNf4Described(
    grouped_description("torchqkit::grouped_linear_nf4wo", "torchqkit::linear_nf4wo"));
const DescribeOp kGroupedIntxDescribed(
    grouped_description("torchqkit::grouped_linear_intxwo", "torchqkit::linear_intxwo"));

}  // namespace
}  // namespace torchqkit_cpu

// Introspection for torchqkit.kernels.cpu_backend(): whether float32 activations take the bf16 prefill kernels now
// (the avx512_bf16 level and torch's fp32 matmul precision "medium" / mkldnn "bf16": Note [fp32 activations in
// bf16]).
namespace torchqkit_cpu {
namespace {
bool fp32_takes_bf16() { return selected_isa_exact() == Isa::kAvx512Bf16 && fp32_matmul_allows_bf16(); }
}  // namespace
}  // namespace torchqkit_cpu

TORCH_LIBRARY_FRAGMENT(torchqkit_cpu, m) { m.def("fp32_takes_bf16() -> bool", &torchqkit_cpu::fp32_takes_bf16); }

TORCH_LIBRARY_IMPL(torchqkit, CPU, m) {
  m.impl("linear_mxwo", &torchqkit_cpu::linear_mxwo);
  m.impl("linear_nf4wo", &torchqkit_cpu::linear_nf4wo);
  m.impl("linear_fp8wo", &torchqkit_cpu::linear_fp8wo);
  m.impl("linear_intxwo", &torchqkit_cpu::linear_intxwo);
  m.impl("linear_nvfp4wo", &torchqkit_cpu::linear_nvfp4wo);
  m.impl("linear_fp6wo", &torchqkit_cpu::linear_fp6wo);
  m.impl("grouped_linear_mxwo", &torchqkit_cpu::grouped_linear_mxwo);
  m.impl("grouped_linear_fp8wo", &torchqkit_cpu::grouped_linear_fp8wo);
  m.impl("grouped_linear_nf4wo", &torchqkit_cpu::grouped_linear_nf4wo);
  m.impl("grouped_linear_intxwo", &torchqkit_cpu::grouped_linear_intxwo);
  m.impl("grouped_linear_nvfp4wo", &torchqkit_cpu::grouped_linear_nvfp4wo);
  m.impl("grouped_linear_fp6wo", &torchqkit_cpu::grouped_linear_fp6wo);
}
