// The float32 prefill below AVX-512 (and on Intel's AVX-512 levels), shared by the int8, int4 and low-bit weight-only
// ops: from some M on, weight rows are dequantized once (by the format's decoder) and multiplied by an fp32 GEMM,
// either ATen's sgemm (prefill_by_sgemm) or this project's 256-bit panels (prefill_by_panels256).
//
// Note [fp32 panels at 256 bits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ATen's sgemm (MKL) ran at 97-103 GFLOP/s on one AMD Zen 5 core with torch's kernels at AVX2 or AVX-512 alike
// (M = 258, K = 4096, N = 2048), where a 6-token x 16-row tile of 256-bit FMAs over a k-major panel of 16 dequantized
// rows ran at 117-122 (scratch C++ loop, panel k blocks of 256-2048): MKL does not run its best code on AMD CPUs. So
// at the AVX2 base level (and AVX-VNNI's, which has no fp32 instruction of its own) the dequantized rows are packed
// into such panels here, except on Intel CPUs, where MKL's sgemm is near the FMA peak (the rule of Note [fp32
// prefill by sgemm], registration.cpp; not measured on an AVX2-only Intel CPU). Each thread decodes its own blocks
// of 16 rows, so the parallel region is the panels' own: no hand-over to sgemm's threads between decode and GEMM.
#pragma once
#include <ATen/ATen.h>
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <vector>

namespace torchqkit_cpu {

constexpr int64_t kSgemmRows = 512;  // 8 MB of fp32 rows at K = 4096

// k per fp32 panel: 4096 x 16 x 4 B = 256 KiB, in L2. AVX2, Zen 5, 2 threads, int8 / nf4 (bf16 x) ms at M = 256 with
// k blocks of 512 / 1024 / 4096: 4096^2 38.9 / 38.1 / 38.4 and 39.0 / 36.8 / 35.3; 4096 x 11008 101.3 / 100.3 / 95.3
// and 103.0 / 98.8 / 93.3.
constexpr int64_t kPanels256Kc = 4096;

// out (M, N) = x (M, k) W^T + bias, W's rows [r0, r1) written by decode(r0, r1, dst) at dst, row stride ldd
// (>= k; columns past k are not read). Rows are handed out in whole multiples of `grain`, which divides
// kSgemmRows (an int4 n-tile is 8 rows). The GEMM runs outside the parallel region: called inside
// at::parallel_for it ran 250x slower (nested OpenMP).
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

// The same product on the 256-bit panels (Note [fp32 panels at 256 bits]): every thread decodes blocks of 16 rows
// (grain divides 16; a decoder may write whole grains past N, the buffer has room for them), packs them k block by
// k block, and runs every token over each panel in 6-token tiles, summing into a 16-column strip per token.
// With `kmap` (ldd entries) the decoder writes a row's weights in another order: its column c holds the weight of
// x's column kmap[c] (none where kmap[c] < 0, e.g. padding past K), and the map permutes within aligned spans of
// at most kPanels256Kc columns, so the decoded columns [k0, k0 + kPanels256Kc) are x's columns of that block. The
// pack puts them in x's order, and x is read as it is.
template <class Decode>
void prefill_by_panels256(const at::Tensor& x, int64_t N, int64_t ldd, const float* bias, at::Tensor& out,
                          Decode decode, const int32_t* kmap = nullptr) {
  constexpr int64_t kCols = kFp32PanelCols;
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0), ldo = out.stride(0);
  const float* a = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // The map relative to each k block's start, made once per call (the pack of block k0 reads to[k0 ...]).
  std::vector<int32_t> to;
  if (kmap != nullptr) {
    to.resize(ldd);
    for (int64_t c = 0; c < ldd; ++c) to[c] = kmap[c] < 0 ? -1 : (int32_t)(kmap[c] - c / kPanels256Kc * kPanels256Kc);
  }
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t b0, int64_t b1) {
    thread_local AlignedVector<float> rows, panel, strip;  // kept across calls; every byte read is written first
    rows.resize(std::max<size_t>(rows.size(), kCols * ldd));
    panel.resize(std::max<size_t>(panel.size(), kPanels256Kc * kCols));
    strip.resize(std::max<size_t>(strip.size(), M * kCols));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kCols, nr = std::min(kCols, N - r0);
      decode(r0, r0 + nr, rows.data());
      for (int64_t k0 = 0; k0 < K; k0 += kPanels256Kc) {
        const int64_t kc = std::min(kPanels256Kc, K - k0);
        if (kmap == nullptr)  // the block's decoded columns, in x's order already
          pack_f32_panel16(rows.data() + k0, ldd, (int)nr, kc, nullptr, panel.data());
        else  // mapped to their k (columns of x past K dropped)
          pack_f32_panel16(rows.data() + k0, ldd, (int)nr, std::min(kPanels256Kc, ldd - k0), to.data() + k0,
                           panel.data());
        for (int64_t m = 0; m < M; m += 6)
          gemm_f32_6x16((int)std::min<int64_t>(6, M - m), a + m * lda + k0, lda, panel.data(), kc,
                        strip.data() + m * kCols, k0 == 0);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nr; ++j) o[m * ldo + r0 + j] = strip[m * kCols + j] + (bias ? bias[r0 + j] : 0.f);
    }
  });
}

// out (M, N) = x W^T + bias on rows dequantized by `decode` (see prefill_by_sgemm), by ATen's sgemm or the 256-bit
// panels (`sgemm` false: fp32_prefill_takes_sgemm's answer at the avx2 level). x: (M, k) float32, rows contiguous.
// The GEMM a dequantizing op at base level `isa` multiplies its rows by: the 256-bit panels only at avx2, where
// fp32_prefill_takes_sgemm picks (the AVX-512 levels' panels read the quantized weight, not dequantized rows).
inline bool dequantized_by_sgemm(Isa isa) {
  return isa != Isa::kAvx2 || fp32_prefill_takes_sgemm(isa, fp32_prefill_rule_sgemm());
}

template <class Decode>
void prefill_dequantized(bool sgemm, const at::Tensor& x, int64_t N, int64_t ldd, int64_t grain, const float* bias,
                         at::Tensor& out, Decode decode) {
  if (!sgemm) return prefill_by_panels256(x, N, ldd, bias, out, decode);
  prefill_by_sgemm(x, N, ldd, grain, bias, out, decode);
}

}  // namespace torchqkit_cpu
