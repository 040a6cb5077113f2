// Plain-C++ interface between the ATen glue (registration.cpp) and the SIMD kernels (linear_int8.cpp).
//
// The kernel translation unit includes no torch header (it compiles in a second); it sees raw pointers,
// row strides and a row range [n0, n1) of the weight, so the glue can split N across at::parallel_for.
// Every pointer may sit at any address (safetensors hands out tensors that are not 16-byte aligned):
// kernels only use unaligned loads and stores.
//
// Note [accumulators in registers]: a kernel's register-blocked accumulators (`__m512 acc[MB][NB]`) stay in
// registers only if (1) the inner step is not a lambda capturing them by reference (write an always_inline
// function taking the array by reference) and (2) every access uses compile-time indices, the epilogue
// included (reduce them all in an unrolled loop to NB, then store the first nr). Otherwise GCC 12 keeps the
// array in memory and stores all of it on every step: perf showed 16 zmm stores per 16 k in the int8
// weight-only dot kernel, 2.5-3x slower at M = 4..8. Check with objdump: no zmm stores to (%rsp) in the loop.
#pragma once
#include <cstdint>

#include "aligned_vector.h"  // Note [scratch on cache lines]

#include <cmath>
#include <limits>

namespace torchqkit_cpu {

// An NVFP4 block scale: the float8 e4m3fn byte's value (NaN for 0x7F / 0xFF) divided by the tensor's global scale
// in float32, the reference's quotient bit for bit (one correctly rounded division; the vector kernels divide the
// same values: scale_row in linear_lowbit_isa.h).
inline float nvfp4_block_scale(uint8_t b, float global) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  float v = (b & 0x7F) == 0x7F ? std::numeric_limits<float>::quiet_NaN()
            : e == 0           ? std::ldexp(static_cast<float>(m), -9)
                               : std::ldexp(1.f + m / 8.f, e - 7);
  if (b & 0x80) v = -v;
  return v / global;
}

// Instruction-set levels. The values are names, not an order: AVX-VNNI (256-bit vpdpbusd: Intel Alder Lake
// and later clients) and AVX-512 VNNI each exist without the other. TORCHQKIT_CPU_ISA can force any level the
// CPU supports (isa_supported), never one it lacks.
// kAvx512Bf16 is AVX-512 VNNI plus AVX512-BF16 (vdpbf16ps); kAvx512Vnni then means "AVX-512 without bf16 dot
// products", so both run and are tested on one CPU. Only the op families with bf16 kernels (low-bit weight-only)
// see kAvx512Bf16: the glue hands every other family its AVX-512 VNNI level (base_isa, vnni_isa), so their
// `isa == Isa::kAvx512Vnni` dispatch stays as it is.
// kAmx is AVX512-BF16 plus AMX tiles (AMX-TILE, AMX-BF16, and the OS's permission to use them): every op runs its
// avx512_bf16 kernels except the bf16 panels of the weight-only prefill, which go to tdpbf16ps (Note [bf16 panels
// on AMX]); the glue sees kAvx512Bf16 (selected_isa_exact) and asks amx_selected() where AMX changes its route.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2, kAvxVnni = 3, kAvx512Bf16 = 4, kAmx = 5 };

Isa detected_isa();              // the best level: AMX, else AVX-512 + BF16, else AVX-512 (F/BW/VL/DQ + VNNI), else
                                 // AVX-VNNI, else AVX2, else scalar
bool isa_supported(Isa isa);     // this CPU runs isa's kernels (AVX2 needs FMA and F16C too)
const char* isa_name(Isa isa);   // "scalar" | "avx2" | "avx_vnni" | "avx512_vnni" | "avx512_bf16" | "amx"
// The level whose kernels serve `isa` in the op families with bf16 kernels: AMX -> AVX512-BF16.
inline Isa bf16_isa(Isa isa) { return isa == Isa::kAmx ? Isa::kAvx512Bf16 : isa; }
// The level whose kernels serve `isa` in the op families without a bf16 kernel: AVX512-BF16 (and AMX) -> AVX-512
// VNNI.
inline Isa vnni_isa(Isa isa) { return bf16_isa(isa) == Isa::kAvx512Bf16 ? Isa::kAvx512Vnni : isa; }
// The level whose kernels serve `isa` in the op families without an AVX-VNNI or bf16 variant (int8 weight-only,
// int8 x int8, int4 weight-only): AVX-VNNI -> AVX2, AVX512-BF16 -> AVX-512 VNNI, the others unchanged.
inline Isa base_isa(Isa isa) { return isa == Isa::kAvxVnni ? Isa::kAvx2 : vnni_isa(isa); }
bool cpu_has_avx_vnni_vex();     // the VEX-encoded AVX-VNNI itself (not only AVX-512 VNNI's EVEX ymm form)

// y[m, n] = sum_k x[m, k] * q[n, k] * scale[n, k / g] + bias[n]        (weight-only int8)
struct WeightOnlyArgs {
  const float* x;       // (M, K) fp32, row stride ldx
  int64_t M, K, ldx;
  const int8_t* w;      // (N, K) int8 codes, row stride ldw
  int64_t N, ldw;
  const float* scale;   // (N, G) fp32, contiguous; g = K / G is the group size (G = 1: per channel)
  int64_t G, g;
  const float* bias;    // (N) fp32 or nullptr
  float* out;           // (M, N) fp32, row stride ldo
  int64_t ldo;
};

// Activations quantized per token: x[m, k] ~ (qa[m, k] - zp[m]) * sa[m], stored shifted to unsigned,
// a[m, k] = qa[m, k] + 128, so that VNNI's u8 x s8 product applies. Then
//   y[m, n] = sa[m] * sw[n] * (sum_k a[m, k] * q[n, k] - (128 + zp[m]) * sum_k q[n, k]) + bias[n].
struct DynamicActArgs {
  const uint8_t* a;       // (M, lda) shifted codes; columns K..lda-1 are zero; lda % 64 == 0
  int64_t M, K, lda;
  const float* a_scale;   // (M)
  const int32_t* a_zp128; // (M) 128 + zero point
  const int8_t* w;        // (N, K) int8 codes, row stride ldw, symmetric per channel
  int64_t N, ldw;
  const float* w_scale;   // (N)
  const float* bias;      // (N) or nullptr
  float* out;             // (M, N), row stride ldo
  int64_t ldo;
  const int16_t* a16 = nullptr;  // the codes a widened to int16, same shape and lda, when
                                 // dynamic_act_wants_a16 (Note [AVX2 int8 prefill]); else nullptr
  const uint8_t* a_amx = nullptr;  // at the amx level, a packed for the tiles (Note [int8 panels on AMX]): the
                                   // panel kernel multiplies on AMX; else nullptr
};

// Rows [m0, m1) of x (fp32, row stride ldx) -> shifted codes, scale and 128 + zero point, with the
// oracle's numerics (core/primitives.py) for `bits`-bit codes qmin..qmax (int8: -128..127; int4: -8..7, stored in
// the same bytes): symmetric s = amax / ((qmax - qmin) / 2), asymmetric s = (hi - lo) / (qmax - qmin) with
// lo <= 0 <= hi and zp = clamp(qmin - round(lo / s)); zero range -> s = 1; s >= float32 eps; s capped at
// float32's edge (Note [Finite range]);
// q = clamp(round_half_even(x / s) [+ zp], qmin, qmax), stored as q + 128.
void quantize_rows(Isa isa, const float* x, int64_t ldx, int64_t K, bool symmetric, uint8_t* a, int64_t lda,
                   float* scale, int32_t* zp128, int64_t m0, int64_t m1, int bits = 8);

// Work split: the glue calls these on blocks of `*_block_rows(...)` weight rows (the last one shorter).
int64_t weight_only_block_rows(Isa isa, const WeightOnlyArgs& p);
void linear_weight_only(Isa isa, const WeightOnlyArgs& p, int64_t n0, int64_t n1);
// AVX512-BF16 weight-only prefill (Note [int8 weight-only in bf16] in linear_int8.cpp): p.x unused, xb the bf16
// activations (M, ldx), ldx >= K rounded up to 32, zero columns past K; at the amx level packed for the tiles as
// `planes` planes that sum to the activations (Note [activations packed for AMX], [fp32 activations on AMX]). Takes the calls weight_only_takes_bf16
// accepts (the panel range, M >= 16, and groups of whole 32-k steps or one per row); blocks of
// weight_only_block_rows(Isa::kAvx512Vnni, p) rows. Call only when the CPU runs Isa::kAvx512Bf16.
bool weight_only_takes_bf16(const WeightOnlyArgs& p);
void linear_weight_only_bf16(const WeightOnlyArgs& p, const uint16_t* xb, int64_t ldx, int planes, int64_t n0,
                             int64_t n1);
// The dynamic-activation functions take the selected level (selected_isa_level()): avx_vnni runs the AVX2 kernels
// except the prefill panels (256-bit vpdpbusd, Note [int8 x int8 prefill on AVX-VNNI] in linear_int8.cpp).
int64_t dynamic_act_block_rows(Isa isa, const DynamicActArgs& p);
bool dynamic_act_wants_a16(Isa isa, int64_t M);  // the glue fills DynamicActArgs::a16 when true
// At the amx level from the panel kernel's M on: the glue fills DynamicActArgs::a_amx (Note [int8 panels on AMX]).
bool dynamic_act_takes_amx(int64_t M);
void linear_dynamic_act(Isa isa, const DynamicActArgs& p, int64_t n0, int64_t n1);

// AVX-512 fp32 GEMM micro-kernel of the weight-only panel path (linear_int8.cpp), shared with linear_int4wo_tiled.cpp:
// C[0:R, 0:ncols] (+)= A[0:R, 0:kc] @ panel[kc][32] (1 <= R <= 6, ncols <= 32; the panel is always read
// 32 wide). Call only when the CPU runs Isa::kAvx512Vnni.
void gemm_f32_6x32(int R, const float* a, int64_t lda, const float* panel, int64_t kc, float* c, int64_t ldc,
                   int ncols, bool first);

// AVX2 + FMA fp32 GEMM of the dequantized weight-only prefill at the 256-bit levels (fp32_panels256.cpp; the driver
// is prefill_by_panels256 in sgemm_prefill.h). Call only when the CPU runs Isa::kAvx2.
// pack_f32_panel16: rows [0, nrows) (nrows <= 16, row stride ldr) x columns [0, ncols) -> panel[k][16] (rows past
// nrows 0), column c at k = c, or with a map `to` at k = to[c] (dropped where to[c] < 0; the map must cover every k
// the GEMM reads).
// gemm_f32_6x16: C[0:R][0:16] (+)= A[0:R, 0:kc] @ panel[kc][16], 1 <= R <= 6, C's row stride 16.
constexpr int64_t kFp32PanelCols = 16;
void pack_f32_panel16(const float* rows, int64_t ldr, int nrows, int64_t ncols, const int32_t* to, float* panel);
void gemm_f32_6x16(int R, const float* a, int64_t lda, const float* panel, int64_t kc, float* c, bool first);

// AVX-512 VNNI pieces of the int8 dynamic-activation panel path (linear_int8.cpp), shared with linear_int8da_int4_packed.cpp.
// pack_s8_panel: rows [0, rows) x k [0, kc) of an int8 matrix (row stride ldw; rows up to 32, kc <= 1024)
// -> panel [ceil(kc/4)][32][4] (missing rows and k zero); rowsum[0:32] += each row's sum of codes.
void pack_s8_panel(const int8_t* w, int64_t ldw, int64_t rows, int64_t kc, int8_t* dst, int32_t* rowsum);
// gemm_u8s8_amx: for rows m < R (<= 32), columns n < ncols (<= 32), with exact int32 d = sum_k a[m][k] * panel[k][n]
// (a: shifted u8 codes, row stride lda, zero past kc), C[m][n] = (add_to_c ? C[m][n] : 0)
//   + (d - a_zp128[m] * rowsum[n]) * a_scale[m] * w_scale[n] + (bias ? bias[n] : 0),
// on AMX-INT8 tiles (the amx level; Note [int8 panels on AMX]): 16 rows of a readable from the last 16-row half's
// first, kc rounded up to 64 with zero codes past kc; loads the tile configuration unless `configured` (the caller
// releases the tiles, amx::release, once done).
void gemm_u8s8_amx(int R, const uint8_t* a, int64_t lda, const int8_t* panel, int64_t kc, float* c, int64_t ldc,
                   int ncols, const float* a_scale, const int32_t* a_zp128, const float* w_scale, const float* bias,
                   const int32_t* rowsum, bool add_to_c, bool& configured);

// ---------------------------------------------------------------- low-bit weight-only (linear_lowbit.cpp)
// The layouts' bytes as stored (see the docstrings of torchqkit/layouts/nf4.py, float8.py, packed_intx.py):
//   y[m, n] = sum_k x[m, k] * (level(n, k) * s(n, k / g) + o(n, k / g)) + bias[n]
// level: nf4 codebook value; fp4 e2m1 value (MXFP4: low nibble first, unlike nf4); float8 e4m3fn value / 256
// (scale_mul = 256 puts it back), e5m2 value, e4m3fnuz value / 128 (scale_mul = 128), e5m2fnuz value (Note [float8
// fnuz bytes] in linear_lowbit_isa.h);
// intx: the unsigned field u plus code_offset (the glue folds qmin, and the code midpoint of a float-domain zero
// point, into code_offset, and the rest of the zero point into o).
// fp6 e3m2 / e2m3 (6-bit fields packed as intx at 6 bits, FP6Layout): the FP6 value (Note [FP6 through fp16], Note
// [FP6 codes to bf16 by vpermi2w] in linear_lowbit_isa.h).
enum class LowbitFormat : int { kNf4 = 0, kFloat8E4m3 = 1, kFloat8E5m2 = 2, kIntx = 3, kFp4E2m1 = 4, kFp6E3m2 = 5,
                                kFp6E2m3 = 6, kFloat8E4m3Fnuz = 7, kFloat8E5m2Fnuz = 8 };

struct LowbitArgs {
  LowbitFormat fmt;
  int bits;               // intx: 1..7
  int code_offset = 0;    // intx: level = u + code_offset
  const float* x;         // (M, K) fp32, row stride ldx >= K rounded up to 32; columns K..ldx-1 are zero
  int64_t M, K, ldx;
  const uint8_t* w;       // (N, row bytes), row stride ldw
  int64_t N, ldw;
  const float* scale;     // (N / bn, G) fp32 contiguous; nullptr: E8M0 or nf4 double quant (below)
  const uint8_t* scale_e8m0;  // MX: (N / bn, G) E8M0 exponents e instead of scale, s = 2^(e - 127)
  const uint8_t* scale_e4m3 = nullptr;  // NVFP4: (N / bn, G) float8 e4m3fn bytes E instead of scale,
  float e4m3_global = 1.f;              //   s = nvfp4_block_scale(E, e4m3_global): E's value / the global scale
  float scale_mul = 1.f;  // every s times this (e4m3: the decoder's 1/256 folded back; e4m3fnuz: 1/128)
  const float* offset;    // (N / bn, G) or nullptr (no offset)
  int64_t G, g, bn;       // g = K / G weights per group along K; bn rows share a scale row
  const int8_t* dq_codes; // nf4 double quant: absmax[i] = dq_codes[i] * dq_scale[i / 256] + dq_offset,
  const float* dq_scale;  //   i = n * G + group (row-major over (N, G))
  float dq_offset;
  const float* bias;      // (N) or nullptr
  float* out;             // (M, N), row stride ldo
  int64_t ldo;
  bool accumulate;        // out += result (prefill k blocks); false: out = result
  // bf16 activations (M, ldx), columns K..ldx-1 zero, instead of x: the AVX512-BF16 kernels (Isa::kAvx512Bf16
  // only; groups must be whole steps of 32, g % 32 == 0, or one per row; the dot kernels need offset == nullptr: the
  // caller adds the zero points' sum_g xsum[m, g] * offset[n, g] itself).
  const uint16_t* xb = nullptr;
  // At the amx level the prefill's xb is packed for the tiles as this many planes that sum to the activations
  // (Note [activations packed for AMX], [fp32 activations on AMX]).
  int xb_planes = 1;
  // With xb and offset, the bf16 prefill adds sum_g xsum[m, g] * offset[n, g] itself: (M, G) fp32 per-group sums.
  const float* xsum = nullptr;
};

// Decode (small M): rows [n0, n1), weights decoded in registers, each byte read once per tile of tokens.
// Both take Isa::kAvx512Bf16: with p.xb its bf16 kernels, else the AVX-512 ones.
void linear_lowbit_dot(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1);
// The order the AVX512-BF16 dot kernel (linear_lowbit_dot with p.xb) takes x in, step by step (Note [Low-bit
// decode steps]): perm[i] = the k within a step of 32 that position i holds. False when that is k order itself.
bool lowbit_bf16_dot_order(const LowbitArgs& p, int64_t* perm);
// Prefill (larger M): rows [n0, n1), decoded once per block of rows and k into an fp32 L2 buffer.
void linear_lowbit_prefill(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1);
// Rows [n0, n1) dequantized to fp32, row n at dst + (n - n0) * ldd, columns [0, K) plus finite values up to the
// next multiple of 32 (ldd >= that; x's zero columns cancel them): the weight an sgemm multiplies (the prefill
// below AVX-512).
void linear_lowbit_decode(Isa isa, const LowbitArgs& p, int64_t n0, int64_t n1, float* dst, int64_t ldd);
// The level TORCHQKIT_CPU_ISA selects (defined in registration.cpp, shared by every op family's glue):
// selected_isa_for_ops() as base_isa; selected_isa_level() as vnni_isa, for the ops that have AVX-VNNI kernels;
// selected_isa_exact() as bf16_isa (AVX512-BF16 included), for the ops that have bf16 kernels (weight-only).
Isa selected_isa_for_ops();
Isa selected_isa_level();
Isa selected_isa_exact();
bool amx_selected();  // the selected level is amx (selected_isa_exact() then says kAvx512Bf16)
// Which build of the AVX-VNNI kernels runs (Note [AVX-VNNI kernels], int4_packed_vec256.inc): the VEX one where the CPU
// has AVX-VNNI, unless TORCHQKIT_CPU_AVX_VNNI=evex asks for the EVEX one (AMD Zen 4's) on a CPU with both.
bool avx_vnni_vex_selected();
// Whether a weight-only op's float32 prefill at base level `isa` multiplies dequantized rows by ATen's sgemm (true)
// or by this project's fp32 panels: the op's own 6x32 ones at avx512_vnni, the 256-bit ones on dequantized rows
// (prefill_by_panels256) at avx2; sgemm at the scalar level. Asked where both can serve the call: the route measured
// fastest for the case, or pinned, or `rule_sgemm` (Note [fp32 prefill by sgemm], registration.cpp; Note [Routes
// chosen by measurement], route_choice.cpp). Call it on the op's calling thread, not inside a parallel region.
bool fp32_prefill_takes_sgemm(Isa isa, bool rule_sgemm);
// The rule's default where no other M threshold applies: sgemm on Intel CPUs, the panels elsewhere.
bool fp32_prefill_rule_sgemm();

}  // namespace torchqkit_cpu
