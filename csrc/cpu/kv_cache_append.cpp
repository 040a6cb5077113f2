// CPU kernel of torchqkit::kv_cache_append: new K / V positions written into one side of a quantized KV cache layer.
//
// The op (schema, fake, reference) is defined in torchqkit/kernels/ops/kv_cache_append.py, whose Note [Quantized KV
// cache layout] says what the tensors hold and which positions stay float; registration.cpp registers this function.
//
// Note [Appending to a quantized KV cache in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decode step appends one position per layer and side; the reference does it with core's choose_qparams_affine /
// quantize_affine, some fifty ATen calls with their checks (about 0.4 ms of CPU per call, 60 calls per SmolLM2
// token: more than the model's int4 linears). The work itself is a few hundred values, so this kernel is plain
// scalar loops with the reference's arithmetic, in the same float32 order, bit for bit:
//   int8 / int4 (asymmetric, float zero point): lo, hi = the block's min and max; scale = (hi - lo) / (qmax - qmin),
//     floored at float16's smallest normal, 1 for a zero range, capped so (mid - qmin) * scale stays finite;
//     zero = lo - (qmin - mid) * scale (centred on the range when capped); both rounded to float16; code =
//     round_half_even((x - zero) / scale + mid) clamped to [qmin, qmax].
//   float8: amax = max |x|; scale = amax / fmax (same floor and cap) rounded to float16; code = float8(clamp(x /
//     scale, -fmax, fmax)), round to nearest even (c10's conversion, the one torch's .to() uses).
// Every block is quantized into temporaries first: NaN / Inf states or a scale float16 can't hold raise before
// anything is written, so a refused call leaves the cache as it was.
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernel_descriptions.h"

namespace torchqkit_cpu {
namespace {

constexpr const char* kOp = "torchqkit::kv_cache_append";

enum class Fmt { kInt8, kInt4, kE4M3, kE5M2 };

Fmt parse_fmt(const std::string& fmt) {
  if (fmt == "int8") return Fmt::kInt8;
  if (fmt == "int4") return Fmt::kInt4;
  if (fmt == "float8_e4m3fn") return Fmt::kE4M3;
  if (fmt == "float8_e5m2") return Fmt::kE5M2;
  TORCH_CHECK_VALUE(false, kOp, ": format '", fmt, "' is not one of int8, int4, float8_e4m3fn, float8_e5m2");
}

constexpr float kHalfTiny = 6.103515625e-05f;  // float16's smallest normal: the scales' floor
constexpr float kHalfEps = 0.0009765625f;      // float16's eps: the cap's margin for rounding the scale up

struct Qparams {
  float scale;  // float16 values, as float
  float zero;
};

// A block's float16 scale (and zero point) from its range, as core's _int_qparams / _float_zero_point (ASYMMETRIC,
// FLOAT zero-point domain) or its absmax branch (float8) compute them, then round them to float16.
Qparams choose(Fmt fmt, float lo, float hi, const std::string& name) {
  const float fmax = std::numeric_limits<float>::max();
  float scale, zero = 0.f;
  if (fmt == Fmt::kInt8 || fmt == Fmt::kInt4) {
    const float qmax = fmt == Fmt::kInt8 ? 255.f : 15.f, mid = fmt == Fmt::kInt8 ? 128.f : 8.f;  // qmin = 0
    const float span = hi - lo;
    float s = std::isfinite(span) ? span / qmax : hi / qmax - lo / qmax;
    s = span > 0.f ? std::max(s, kHalfTiny) : 1.f;
    const float bound = (fmax * (1.f - kHalfEps)) / std::max(mid, qmax - mid);
    const float capped = s > bound ? bound : s;
    zero = capped < s ? lo / 2.f + hi / 2.f - (qmax / 2.f - mid) * capped : lo - (0.f - mid) * s;
    scale = capped;
  } else {
    const float level = fmt == Fmt::kE4M3 ? 448.f : 57344.f;
    const float amax = std::max(-lo, hi);
    float s = amax / level;
    s = amax > 0.f ? std::max(s, kHalfTiny) : 1.f;
    const float bound = (fmax * (1.f - kHalfEps)) / level;
    scale = s > bound ? bound : s;
  }
  const float scale_h = static_cast<float>(c10::Half(scale)), zero_h = static_cast<float>(c10::Half(zero));
  TORCH_CHECK_VALUE(std::isfinite(scale_h) && std::isfinite(zero_h), name, ": a block of new positions spans [", lo,
                    ", ", hi, "], whose scale or zero point float16 can't hold; the cache is unchanged. Keep these "
                    "layers' keys and values in a float cache");
  return {scale_h, zero_h};
}

// The code of x under q (stored bits: unsigned int8 / int4 codes, float8 bytes).
uint8_t encode(Fmt fmt, float x, const Qparams& q) {
  switch (fmt) {
    case Fmt::kInt8:
    case Fmt::kInt4: {
      const float qmax = fmt == Fmt::kInt8 ? 255.f : 15.f, mid = fmt == Fmt::kInt8 ? 128.f : 8.f;
      const float v = std::nearbyint((x - q.zero) / q.scale + mid);  // default rounding mode: half to even
      return static_cast<uint8_t>(std::min(std::max(v, 0.f), qmax));
    }
    case Fmt::kE4M3:
      return c10::Float8_e4m3fn(std::min(std::max(x / q.scale, -448.f), 448.f)).x;
    case Fmt::kE5M2:
      return c10::Float8_e5m2(std::min(std::max(x / q.scale, -57344.f), 57344.f)).x;
  }
  return 0;
}

const char* const kSame = "scalar loops at every level (a few hundred values per decode step): each block's range, "
                          "float16 scale and zero point, and codes, bit for bit the reference's; nothing written "
                          "before every block is checked";
const DescribeOp kDescribed(OpDescription(kOp).at("avx512_vnni", kSame).at("avx2", kSame).at("scalar", kSame));

}  // namespace

void kv_cache_append(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& tail,
                     const at::Tensor& counts, const at::Tensor& states, std::string fmt_name, int64_t group,
                     bool per_channel, int64_t residual_length, std::string name) {
  const Fmt fmt = parse_fmt(fmt_name);
  TORCH_CHECK_VALUE(counts.scalar_type() == at::kLong && counts.numel() == 2 && counts.is_contiguous(), kOp,
                    ": counts must be a contiguous int64 tensor [length, quantized length], got ",
                    counts.scalar_type(), " ", counts.sizes());
  TORCH_CHECK_VALUE(states.dim() == 4 && tail.dim() == 4 && codes.dim() == 4 && scale.dim() == 4, kOp,
                    ": codes, scale, tail and states must be (B, H, positions, ...) tensors");
  int64_t* count = counts.data_ptr<int64_t>();
  const int64_t n = count[0], nq = count[1], T = states.size(2);
  const int64_t B = states.size(0), H = states.size(1), D = states.size(3);
  const int64_t new_n = n + T;
  TORCH_CHECK_VALUE(new_n <= codes.size(2), name, ": ", T, " new positions after ", n, " need ", new_n,
                    ", past the cache's max_length=", codes.size(2),
                    "; build the QuantizedKVCache with a larger max_length");
  const bool is_int = fmt == Fmt::kInt8 || fmt == Fmt::kInt4;
  const int64_t width = fmt == Fmt::kInt4 ? (D + 1) / 2 : D;
  TORCH_CHECK_VALUE(group > 0 && (per_channel || D % group == 0), kOp, ": group ", group,
                    " must be positive and divide the head dim ", D, " for per-token groups");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte && codes.size(0) == B && codes.size(1) == H &&
                        codes.size(3) == width && codes.stride(3) == 1,
                    kOp, ": codes must be uint8 (", B, ", ", H, ", capacity, ", width, "), got ", codes.sizes());
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kHalf && scale.size(3) == (per_channel ? D : D / group) &&
                        scale.stride(3) == 1 && (!is_int || (zero.sizes() == scale.sizes() &&
                                                             zero.strides() == scale.strides() &&
                                                             zero.scalar_type() == at::kHalf)),
                    kOp, ": scale (and zero, for int formats) must be float16 in the layout of Note [Quantized KV "
                    "cache layout], got scale ", scale.sizes(), " zero ", zero.sizes());
  TORCH_CHECK_VALUE(tail.scalar_type() == at::kFloat && tail.size(3) == D && tail.stride(3) == 1 &&
                        tail.size(0) == B && tail.size(1) == H,
                    kOp, ": tail must be float32 (", B, ", ", H, ", rows, ", D, "), got ", tail.scalar_type(), " ",
                    tail.sizes());
  const int64_t block = per_channel ? group : 1;
  const int64_t new_nq = std::max(nq, (std::max<int64_t>(0, new_n - residual_length) / block) * block);
  const int64_t keep = new_n - new_nq, P = new_nq - nq;  // tail rows after the call; positions quantized now
  TORCH_CHECK_VALUE(keep <= tail.size(2), kOp, ": the tail holds ", tail.size(2), " rows, the call leaves ", keep);

  const at::Tensor x = states.to(at::kFloat).contiguous();
  if (P == 0) {  // nothing leaves the tail (most decode steps of a per-channel or residual cache): append to it
    // (as the reference, values are checked when they are quantized, not here)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(tail.data_ptr<float>() + b * tail.stride(0) + h * tail.stride(1) + (n - nq) * tail.stride(2),
                    x.data_ptr<float>() + (b * H + h) * T * D, sizeof(float) * T * D);
    count[0] = new_n;
    return;
  }
  // pending positions [nq, new_n): the tail's n - nq rows, then the states

  std::vector<float> pending(B * H * (new_n - nq) * D);
  const int64_t old = n - nq, rows = new_n - nq;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      float* dst = pending.data() + (b * H + h) * rows * D;
      for (int64_t j = 0; j < old; ++j)
        std::memcpy(dst + j * D, tail.data_ptr<float>() + b * tail.stride(0) + h * tail.stride(1) + j * tail.stride(2),
                    sizeof(float) * D);
      std::memcpy(dst + old * D, x.data_ptr<float>() + (b * H + h) * T * D, sizeof(float) * T * D);
    }
  // quantize positions [nq, new_nq) into temporaries: codes (one per value), qparams per block
  std::vector<uint8_t> q(B * H * P * D);
  const int64_t blocks_per_bh = per_channel ? (P / group) * D : P * (D / group);
  std::vector<Qparams> qp(B * H * blocks_per_bh);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const float* src = pending.data() + bh * rows * D;
    uint8_t* qc = q.data() + bh * P * D;
    Qparams* qb = qp.data() + bh * blocks_per_bh;
    // block k covers elements (p, d) for p in [p0, p0 + pn), d in [d0, d0 + dn)
    for (int64_t k = 0; k < blocks_per_bh; ++k) {
      int64_t p0, pn, d0, dn;
      if (per_channel) { p0 = (k / D) * group; pn = group; d0 = k % D; dn = 1; }
      else { p0 = k / (D / group); pn = 1; d0 = (k % (D / group)) * group; dn = group; }
      float lo = std::numeric_limits<float>::infinity(), hi = -lo;
      for (int64_t p = p0; p < p0 + pn; ++p)
        for (int64_t d = d0; d < d0 + dn; ++d) {
          const float v = src[p * D + d];
          TORCH_CHECK_VALUE(std::isfinite(v), name, ": the new positions hold NaN / Inf values (position ", nq + p,
                            ", channel ", d, "); the cache is unchanged. The model produced non-finite keys or "
                            "values: check its inputs and dtype");
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
      qb[k] = choose(fmt, lo, hi, name);
      for (int64_t p = p0; p < p0 + pn; ++p)
        for (int64_t d = d0; d < d0 + dn; ++d) qc[p * D + d] = encode(fmt, src[p * D + d], qb[k]);
    }
  }
  // write: codes, scales (and zeros), the tail, the counts
  uint8_t* cdata = codes.data_ptr<uint8_t>();
  uint16_t* sdata = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  uint16_t* zdata = is_int ? reinterpret_cast<uint16_t*>(zero.data_ptr<at::Half>()) : nullptr;
  const int64_t srow0 = per_channel ? nq / group : nq, scols = per_channel ? D : D / group;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h;
      const uint8_t* qc = q.data() + bh * P * D;
      for (int64_t p = 0; p < P; ++p) {
        uint8_t* row = cdata + b * codes.stride(0) + h * codes.stride(1) + (nq + p) * codes.stride(2);
        if (fmt == Fmt::kInt4) {
          for (int64_t i = 0; i < width; ++i) {
            const uint8_t hi_nibble = 2 * i + 1 < D ? qc[p * D + 2 * i + 1] : 0;
            row[i] = static_cast<uint8_t>(qc[p * D + 2 * i] | (hi_nibble << 4));
          }
        } else {
          std::memcpy(row, qc + p * D, D);
        }
      }
      const Qparams* qb = qp.data() + bh * blocks_per_bh;
      for (int64_t k = 0; k < blocks_per_bh; ++k) {
        const int64_t r = srow0 + k / scols, c = k % scols;
        const int64_t off = b * scale.stride(0) + h * scale.stride(1) + r * scale.stride(2) + c;
        sdata[off] = c10::Half(qb[k].scale).x;
        if (zdata) zdata[off] = c10::Half(qb[k].zero).x;
      }
      const float* left = pending.data() + bh * rows * D + P * D;
      for (int64_t j = 0; j < keep; ++j)
        std::memcpy(tail.data_ptr<float>() + b * tail.stride(0) + h * tail.stride(1) + j * tail.stride(2),
                    left + j * D, sizeof(float) * D);
    }
  count[0] = new_n;
  count[1] = new_nq;
}

}  // namespace torchqkit_cpu
