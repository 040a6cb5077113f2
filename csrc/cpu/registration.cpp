// CPU backend of the torchqkit int8 linear ops: argument checks, dtype plumbing, threads, ISA choice.
//
// The schemas (and fake + reference impls) are defined in Python, torchqkit/kernels/ops/ (one module per op); this
// file only registers the CPU kernels for them. It also defines torchqkit_cpu::isa() so Python can
// report which ISA level serves the ops, and torchqkit_cpu::kernel_descriptions() with what each kernel does there.
#include <ATen/ATen.h>
#include "parallel.h"
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

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
using torchqkit_glue::float_bias;
using torchqkit_glue::out_shape;

// The level the CPU runs, or the one TORCHQKIT_CPU_ISA=amx|avx512_bf16|avx512_vnni|avx_vnni|avx2|scalar forces (read
// on every call so tests can switch levels in-process). Asking for a level the CPU lacks is an error, never a crash.
Isa selected_isa() {
  const Isa detected = detected_isa();
  const char* env = std::getenv("TORCHQKIT_CPU_ISA");
  if (env == nullptr || *env == '\0') return detected;
  Isa wanted;
  if (std::strcmp(env, "amx") == 0) wanted = Isa::kAmx;
  else if (std::strcmp(env, "avx512_bf16") == 0) wanted = Isa::kAvx512Bf16;
  else if (std::strcmp(env, "avx512_vnni") == 0) wanted = Isa::kAvx512Vnni;
  else if (std::strcmp(env, "avx_vnni") == 0) wanted = Isa::kAvxVnni;
  else if (std::strcmp(env, "avx2") == 0) wanted = Isa::kAvx2;
  else if (std::strcmp(env, "scalar") == 0) wanted = Isa::kScalar;
  else
    TORCH_CHECK(false, "TORCHQKIT_CPU_ISA=", env, " is not one of amx, avx512_bf16, avx512_vnni, avx_vnni, avx2, scalar");
  TORCH_CHECK(isa_supported(wanted), "TORCHQKIT_CPU_ISA=", env, " but this CPU does not run it (its best level is ",
              isa_name(detected), "); unset it or pick another level");
  return wanted;
}

std::string isa_op() { return isa_name(selected_isa()); }

}  // namespace

bool avx_vnni_vex_selected() {
  const char* env = std::getenv("TORCHQKIT_CPU_AVX_VNNI");
  if (env == nullptr || *env == '\0') return cpu_has_avx_vnni_vex();
  if (std::strcmp(env, "vex") == 0) {
    TORCH_CHECK(cpu_has_avx_vnni_vex(), "TORCHQKIT_CPU_AVX_VNNI=vex but this CPU has no AVX-VNNI (its AVX-VNNI level "
                "runs the EVEX build); unset it");
    return true;
  }
  TORCH_CHECK(std::strcmp(env, "evex") == 0, "TORCHQKIT_CPU_AVX_VNNI=", env, " is not one of vex, evex");
  TORCH_CHECK(isa_supported(Isa::kAvx512Vnni), "TORCHQKIT_CPU_AVX_VNNI=evex but this CPU has no AVX-512 VNNI, which the "
              "EVEX build needs; unset it");
  return false;
}

namespace {

bool cpu_is_intel() {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
}

}  // namespace

// Note [fp32 prefill by sgemm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Below AVX-512 the weight-only ops' float32 prefill dequantizes rows once and multiplies them by an fp32 GEMM
// (prefill_dequantized in sgemm_prefill.h: ATen's sgemm, or the 256-bit panels by the rule below). With AVX-512 they
// have
// 6x32 FMA panels, which run near ATen's sgemm where a core has one 512-bit FMA pipe (AMD Zen 4, where they measured
// 1.0-1.25x fp32 F.linear at M = 256) but at about half its speed on Intel's two-pipe cores, where MKL's sgemm is
// near the FMA peak. Intel Xeon (Sapphire Rapids class), 2 threads, 4096^2, forced to avx512_vnni, ms panels /
// sgemm (TORCHQKIT_CPU_FP32_PREFILL=panels|sgemm python benchmarks/bench_linear.py --formats int8,nf4,fp8
// --shapes 4096:4096 --ms 64,128,256 --no-native): M = 256 int8 31.7 / 27.4, nf4 39.8 / 27.1, fp8 42.2 / 27.4;
// M = 128 int8 17.1 / 15.6, nf4 24.0 / 15.4; M = 64 a tie for int8 (9.6), fp32 F.linear 24 / 13 / 8.5 ms.
// int4 (rows dequantized in the permuted k order by dequant_tiles' vector code, x's columns permuted to match):
// M = 256 32.1 / 27.4, M = 128 16.2 / 15.4, M = 64 8.2 / 7.8; int4 takes the route from M = 128 only
// (kAvx512SgemmMinM), where it was measured to win with the scalar dequantization it had before.
// So the rule: on Intel CPUs the AVX-512 levels of the int8, int4 and low-bit ops take the sgemm route (int8 and
// low-bit from the M their AVX2 levels do); elsewhere the panels. The AVX2 level follows the same rule for the GEMM it
// runs on the dequantized rows (Note [fp32 panels at 256 bits] in sgemm_prefill.h). The rule is what a case takes
// unmeasured: each case is timed both ways at its first call (Note [Routes chosen by measurement] in
// route_choice.cpp; an Intel core with one 512-bit FMA pipe, client Ice / Tiger Lake or some Xeon Silver, may well
// measure the panels faster). TORCHQKIT_CPU_FP32_PREFILL=sgemm|panels pins a route at the AVX-512 and AVX2 levels
// (read on every call, like TORCHQKIT_CPU_ISA, so tests cover both routes on one machine).
bool fp32_prefill_rule_sgemm() {
  static const bool intel = cpu_is_intel();
  return intel;
}

bool fp32_prefill_takes_sgemm(Isa isa, bool rule_sgemm) {
  if (isa != Isa::kAvx512Vnni && isa != Isa::kAvx2) return true;  // the scalar level has no panels
  return take_route(RouteSite::kFp32Prefill, route_bit(kPanelsRoute) | route_bit(kSgemmRoute),
                    rule_sgemm ? kSgemmRoute : kPanelsRoute) == kSgemmRoute;
}

namespace {

// From this M the int8 weight-only op below AVX-512 multiplies dequantized rows by ATen's sgemm (the rows, 4 bytes
// per weight, are written and read again: at M = 32 that costs more than the dot kernel's compute).
constexpr int64_t kInt8SgemmMinM = 48;  // AVX2, 4096^2, 2 threads: the dot kernel wins at M = 32, loses at 64

// Rows [r0, r1) of the int8 weight as fp32 code * scale (the scale of the code's group), row n at dst + (n - r0) * ldd.
void dequantize_int8_rows(const WeightOnlyArgs& p, int64_t r0, int64_t r1, float* dst, int64_t ldd) {
  for (int64_t n = r0; n < r1; ++n) {
    const int8_t* w = p.w + n * p.ldw;
    const float* s = p.scale + n * p.G;
    float* d = dst + (n - r0) * ldd;
    for (int64_t gi = 0; gi < p.G; ++gi)
      for (int64_t k = gi * p.g; k < (gi + 1) * p.g; ++k) d[k] = static_cast<float>(w[k]) * s[gi];
  }
}

void check_weight(const at::Tensor& x, const at::Tensor& qdata, const char* op) {
  TORCH_CHECK(qdata.dim() == 2 && qdata.scalar_type() == at::kChar, op, ": qdata must be a 2-D int8 (N, K) tensor, got ",
              qdata.scalar_type(), " of shape ", qdata.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == qdata.size(1), op, ": x has ", x.size(-1),
              " features but the weight has K = ", qdata.size(1));
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": activations must be float32, bfloat16 or float16, got ", dt);
}

at::Tensor linear_int8wo_plain_kernels(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                                       const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "torchqkit::linear_int8wo_plain";
  check_weight(x, qdata, op);
  const int64_t N = qdata.size(0), K = qdata.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) >= 1 && K % scale.size(1) == 0, op,
              ": scale must be (N, K / group_size) = (", N, ", G) with G dividing K = ", K, ", got ", scale.sizes());
  const at::Tensor w = rows(qdata), s = scale.to(at::kFloat).contiguous(), b = float_bias(bias, N, op);
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  WeightOnlyArgs p{nullptr, M, K, K, w.data_ptr<int8_t>(), N, w.stride(0), s.data_ptr<float>(), s.size(1),
                   K / s.size(1), b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
  // bf16 activations, and float32 ones when torch allows bf16 matmuls (Note [fp32 activations in bf16]) or as
  // three planes on AMX (Note [fp32 activations on AMX]), take the AVX512-BF16 prefill where it runs (Note [int8
  // weight-only in bf16] in linear_int8.cpp).
  const Isa level = selected_isa_exact();
  const auto dt = x.scalar_type();
  const bool panels = M > 0 && N > 0 && level == Isa::kAvx512Bf16 && weight_only_takes_bf16(p);
  const bool planes = panels && fp32_takes_amx_planes(dt);
  if (panels && (dt == at::kBFloat16 || (dt == at::kFloat && fp32_matmul_allows_bf16()) || planes)) {
    const int64_t K32 = (K + 31) / 32 * 32;
    const Bf16Activations a = bf16_activations(x.reshape({M, K}), K32, planes ? 3 : 1, amx_selected());
    const int64_t block = balanced_rows(N, weight_only_block_rows(Isa::kAvx512Vnni, p), 32);
    at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
      linear_weight_only_bf16(p, a.ptr(), a.ldx, a.planes, b0 * block, std::min(b1 * block, N));
    });
    return out.to(x.scalar_type()).reshape(out_shape(x, N));
  }
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  p.x = x2.data_ptr<float>();
  const Isa isa = base_isa(level);  // no AVX-VNNI variant: its AVX2 kernel
  // Below AVX-512 the dot kernel is an fp32 GEMM at a quarter of its FMA rate (4 rows x 2 tokens per pass: 0.35-0.40x
  // fp32 F.linear at M = 256 on Intel); rows dequantized once + ATen's sgemm tie F.linear, the 256-bit panels beat it
  // on AMD (prefill_dequantized). The AVX-512 levels take the sgemm route where it is faster than their panels (Note
  // [fp32 prefill by sgemm]).
  const bool sgemm = M >= kInt8SgemmMinM && N > 0 && fp32_prefill_takes_sgemm(isa, fp32_prefill_rule_sgemm());
  if (M >= kInt8SgemmMinM && N > 0 && (sgemm || isa != Isa::kAvx512Vnni)) {
    prefill_dequantized(sgemm, x2, N, K, 16, p.bias, out, [&](int64_t r0, int64_t r1, float* dst) {
      dequantize_int8_rows(p, r0, r1, dst, K);
    });
    return out.to(x.scalar_type()).reshape(out_shape(x, N));
  }
  if (M > 0 && N > 0) {
    const int64_t block = balanced_rows(N, weight_only_block_rows(isa, p), 32);
    at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
      linear_weight_only(isa, p, b0 * block, std::min(b1 * block, N));
    });
  }
  return out.to(x.scalar_type()).reshape(out_shape(x, N));
}

// The kernels under the routes measured for the case (Note [Routes chosen by measurement]).
at::Tensor linear_int8wo_plain(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                               const std::optional<at::Tensor>& bias) {
  const int64_t K = qdata.dim() == 2 ? qdata.size(1) : 0, N = qdata.dim() == 2 ? qdata.size(0) : 0;
  const int64_t M = K > 0 && x.dim() >= 1 && x.size(-1) == K ? x.numel() / K : 0;
  const int64_t groups = scale.dim() == 2 ? scale.size(1) : 0;
  // keyed by the level whose kernels run: AVX-VNNI shares the AVX2 level's measured routes
  const RouteCase c{"torchqkit::linear_int8wo_plain", (int)base_isa(selected_isa_exact()), (int)x.scalar_type(), M,
                    N, K, groups};
  return measured_routes(c, [&] { return linear_int8wo_plain_kernels(x, qdata, scale, bias); });
}

at::Tensor linear_int8da_int8_plain(const at::Tensor& x, const at::Tensor& qdata, const at::Tensor& scale,
                                    const std::optional<at::Tensor>& bias, bool act_symmetric) {
  constexpr const char* op = "torchqkit::linear_int8da_int8_plain";
  check_weight(x, qdata, op);
  const int64_t N = qdata.size(0), K = qdata.size(1);
  TORCH_CHECK(scale.numel() == N && (scale.dim() == 1 || (scale.dim() == 2 && scale.size(1) == 1)), op,
              ": scale must be per output channel, (N, 1) = (", N, ", 1), got ", scale.sizes());
  TORCH_CHECK(K < (1 << 16), op, ": K = ", K, " could overflow the int32 accumulator (limit 65535)");
  const at::Tensor x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const at::Tensor w = rows(qdata), s = scale.to(at::kFloat).reshape({N}).contiguous(), b = float_bias(bias, N, op);
  const int64_t M = x2.size(0), lda = (K + 63) / 64 * 64;
  at::Tensor out = at::empty({M, N}, x2.options());
  if (M > 0 && N > 0) {
    const Isa isa = selected_isa_level();  // AVX-VNNI: the AVX2 kernels, except the prefill panels
    at::Tensor a = at::empty({M, lda}, x2.options().dtype(at::kByte));
    at::Tensor a_scale = at::empty({M}, x2.options());
    at::Tensor a_zp = at::empty({M}, x2.options().dtype(at::kInt));
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      quantize_rows(isa, x2.data_ptr<float>(), K, K, act_symmetric, a.data_ptr<uint8_t>(), lda,
                    a_scale.data_ptr<float>(), a_zp.data_ptr<int32_t>(), m0, m1);
    });
    DynamicActArgs p{a.data_ptr<uint8_t>(), M, K, lda, a_scale.data_ptr<float>(), a_zp.data_ptr<int32_t>(),
                           w.data_ptr<int8_t>(), N, w.stride(0), s.data_ptr<float>(),
                           b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
    at::Tensor a16, a_amx;
    if (dynamic_act_wants_a16(isa, M)) {
      a16 = a.to(at::kShort);
      p.a16 = a16.data_ptr<int16_t>();
    }
    if (dynamic_act_takes_amx(M)) {
      a_amx = amx_packed_codes(a);
      p.a_amx = a_amx.data_ptr<uint8_t>();
    }
    const int64_t block = balanced_rows(N, dynamic_act_block_rows(isa, p), 32);
    at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
      linear_dynamic_act(isa, p, b0 * block, std::min(b1 * block, N));
    });
  }
  return out.to(x.scalar_type()).reshape(out_shape(x, N));
}

// What kernels.status() says serves each op at each level (Note [Kernel descriptions] in kernel_descriptions.cpp).
const DescribeOp kInt8WeightOnlyDescribed(
    OpDescription("torchqkit::linear_int8wo_plain")
        .at("avx512_vnni",
            "M < 16: streams each weight row once (dot kernel); M >= 16: fp32 panels + 6x32 FMA tiles, except from "
            "M = 48 on Intel CPUs: blocks of 512 rows dequantized to fp32, then ATen's fp32 GEMM (" +
                kFp32PrefillSgemm + ")")
        .at("avx512_bf16",
            "M < 16: the avx512_vnni dot kernel (fp32; bf16 activations converted); M >= 16 with bf16 activations "
            "(groups of whole 32-k steps or per channel): int8 codes as exact bf16 in k-pair panels + 6x32 vdpbf16ps "
            "tiles, fp32 sums, the scale per segment; else the avx512_vnni kernels")
        .at("avx2",
            "M < 48: dot kernel (4 rows x 2 tokens, 8 lanes); M >= 48: rows dequantized to fp32 16 at a time into "
            "k-major panels + 6x16 FMA tiles, on Intel CPUs blocks of 512 rows dequantized to fp32, then ATen's fp32 "
            "GEMM (" + kFp32PrefillPanels256 + ")")
        .at("scalar",
            "plain loops (M >= 48: dequantized blocks + ATen's fp32 GEMM): the CPU has no AVX2+FMA, or "
            "TORCHQKIT_CPU_ISA forced it")
        .fp32_in_bf16("M >= 16", "M >= 16")
        .fp32_prefill_routes());

const DescribeOp kInt8DynamicActDescribed(
    OpDescription("torchqkit::linear_int8da_int8_plain")
        .at("amx",
            "amx: M >= 8 the packed VNNI panels multiply on AMX-INT8 tiles (tdpbusd, 32 tokens x 32 rows, the codes "
            "packed per call; exact int32 sums, the same epilogue: Note [int8 panels on AMX]); below, the "
            "avx512_vnni dot kernel")
        .at("avx512_vnni",
            "vpdpbusd (u8 = q + 128 times s8, corrected by row sums); M >= 8: packed panels, 6x32 tiles")
        .at("avx_vnni",
            "M < 16: the AVX2 dot kernel; M >= 16: int8 k-quad panels + 6x16 tiles of 256-bit vpdpbusd (VEX; EVEX on "
            "ymm where only AVX-512 VNNI exists; Note [int8 x int8 prefill on AVX-VNNI])")
        .at("avx2", "exact int16 madd (vpmaddwd): M < 16 dot kernel; M >= 16 int16 k-pair panels + 6x16 tiles")
        .at("scalar", "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it"));

// Stacks of experts (E, N, K) of int8 codes, scale (E, N) or (E, N, groups): rows [offs[g - 1], offs[g]) of x
// through expert g (Note [Grouped linear in C++], grouped_rows.h).
void check_stack(const char* op, const at::Tensor& qdata, const at::Tensor& scale) {
  TORCH_CHECK(qdata.dim() == 3 && scale.dim() >= 2 && qdata.size(0) == scale.size(0), op,
              ": qdata (E, N, K) and scale (E, N[, groups]) of the same E experts, got ", qdata.sizes(), " and ",
              scale.sizes());
}

at::Tensor grouped_linear_int8wo_plain(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                       const at::Tensor& scale) {
  constexpr const char* op = "torchqkit::grouped_linear_int8wo_plain";
  check_stack(op, qdata, scale);
  return grouped_rows(op, x, offs, qdata.size(0), qdata.size(1), [&](const at::Tensor& rows, int64_t g) {
    return linear_int8wo_plain(rows, qdata.select(0, g), scale.select(0, g), {});
  });
}

at::Tensor grouped_linear_int8da_int8_plain(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& qdata,
                                            const at::Tensor& scale, bool act_symmetric) {
  constexpr const char* op = "torchqkit::grouped_linear_int8da_int8_plain";
  check_stack(op, qdata, scale);
  return grouped_rows(op, x, offs, qdata.size(0), qdata.size(1), [&](const at::Tensor& rows, int64_t g) {
    return linear_int8da_int8_plain(rows, qdata.select(0, g), scale.select(0, g), {}, act_symmetric);
  });
}

const DescribeOp kGroupedInt8WeightOnlyDescribed(
    grouped_description("torchqkit::grouped_linear_int8wo_plain", "torchqkit::linear_int8wo_plain"));
const DescribeOp kGroupedInt8DynamicActDescribed(
    grouped_description("torchqkit::grouped_linear_int8da_int8_plain", "torchqkit::linear_int8da_int8_plain"));

}  // namespace

Isa selected_isa_for_ops() { return base_isa(selected_isa()); }
Isa selected_isa_level() { return vnni_isa(selected_isa()); }
Isa selected_isa_exact() { return bf16_isa(selected_isa()); }
bool amx_selected() { return selected_isa() == Isa::kAmx; }

// Defined in decode_attention_ops.cpp (attention over the filled positions of a static KV cache).
at::Tensor sdpa_over_filled_cache(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& attn_mask, double scale, bool enable_gqa);
// Defined in quantized_kv_attention_ops.cpp (attention over a quantized KV cache).
at::Tensor sdpa_quantized_kv_cache(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                   const at::Tensor& k_zero, const at::Tensor& k_tail, const at::Tensor& k_counts,
                                   const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                                   const at::Tensor& v_tail, const at::Tensor& v_counts,
                                   const std::optional<at::Tensor>& attn_mask, double scale, bool enable_gqa,
                                   std::string k_format, int64_t k_group, bool k_per_channel, std::string v_format,
                                   int64_t v_group);
// Defined in kv_cache_append.cpp (new positions written into a quantized KV cache layer).
void kv_cache_append(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& tail,
                     const at::Tensor& counts, const at::Tensor& states, std::string fmt_name, int64_t group,
                     bool per_channel, int64_t residual_length, std::string name);
// Defined in fake_quantize_activation.cpp (float8 / MXFP8 / NVFP4 activations quantized and dequantized).
at::Tensor fake_quantize_activation(const at::Tensor& x, std::string qdtype, int64_t group_size, bool per_tensor,
                                    std::optional<double> static_scale, const std::optional<at::Tensor>& offs);

}  // namespace torchqkit_cpu

TORCH_LIBRARY_IMPL(torchqkit, CPU, m) {
  m.impl("linear_int8wo_plain", &torchqkit_cpu::linear_int8wo_plain);
  m.impl("linear_int8da_int8_plain", &torchqkit_cpu::linear_int8da_int8_plain);
  m.impl("grouped_linear_int8wo_plain", &torchqkit_cpu::grouped_linear_int8wo_plain);
  m.impl("grouped_linear_int8da_int8_plain", &torchqkit_cpu::grouped_linear_int8da_int8_plain);
  m.impl("sdpa_over_filled_cache", &torchqkit_cpu::sdpa_over_filled_cache);
  m.impl("sdpa_quantized_kv_cache", &torchqkit_cpu::sdpa_quantized_kv_cache);
  m.impl("kv_cache_append", &torchqkit_cpu::kv_cache_append);
  m.impl("fake_quantize_activation", &torchqkit_cpu::fake_quantize_activation);
}

namespace torchqkit_cpu {
// The GEMM the weight-only ops' float32 prefill runs on at the selected level, for kernels.status(): "panels" (the
// AVX-512 6x32 or the 256-bit 6x16 ones) or "sgemm" (ATen's, on dequantized rows; the scalar level's only one).
// A case measured at its first call may take the other one (routes() lists those).
std::string fp32_prefill_route_op() {
  const Isa isa = selected_isa_for_ops();  // outside an op call take_route answers the pin, else the rule
  return fp32_prefill_takes_sgemm(isa, fp32_prefill_rule_sgemm()) ? "sgemm" : "panels";
}

std::string routes_op() { return routes_json(); }
void clear_routes_op() { clear_routes(); }
int64_t add_routes_op(const std::string& lines) { return add_routes(lines); }
}  // namespace torchqkit_cpu

// Introspection for torchqkit.kernels.status(); not a quantized op, so it lives in its own namespace.
TORCH_LIBRARY(torchqkit_cpu, m) {
  m.def("isa() -> str", &torchqkit_cpu::isa_op);
  m.def("fp32_prefill_route() -> str", &torchqkit_cpu::fp32_prefill_route_op);
  m.def("kernel_descriptions() -> str", &torchqkit_cpu::kernel_descriptions_json);
  m.def("routes() -> str", &torchqkit_cpu::routes_op);
  m.def("clear_routes() -> ()", &torchqkit_cpu::clear_routes_op);
  m.def("add_routes(str lines) -> int", &torchqkit_cpu::add_routes_op);
}
