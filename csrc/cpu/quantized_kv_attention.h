// Plain-C++ interface between the ATen glue (quantized_kv_attention_ops.cpp) and the kernels
// (quantized_kv_attention.cpp) of torchqkit::sdpa_quantized_kv_cache: softmax(q k^T * scale + mask) v over the n
// positions of a quantized KV cache, K and V read from their codes. No torch header (see kernels.h).
//
// One side of the cache (K or V), for batch b, kv head h and position j < n (see Note [Quantized KV cache layout]
// in torchqkit/kernels/ops/kv_cache_append.py for what the Python side writes):
//   j <  nq: codes row  codes + b * c_sb + h * c_sh + j * c_ss (bytes): D codes, one byte each (int8, float8), or
//            two per byte for int4 (element 2i in the low nibble of byte i);
//            scales  per token: scale[b, h, j, d / group]       per channel: scale[b, h, j / group, d]
//            value   int: (code - mid) * scale + zero (mid 128 for int8, 8 for int4); float8: decoded * scale;
//            scales and zeros are float16 (their bits, uint16)
//   j >= nq: the float row tail + b * t_sb + h * t_sh + (j - nq) * t_ss
#pragma once
#include <cstdint>

#include "kernels.h"

namespace torchqkit_cpu {

enum class KvFormat : int { kInt8 = 0, kInt4 = 1, kFloat8E4M3 = 2, kFloat8E5M2 = 3 };

struct QuantizedSide {
  const uint8_t* codes;
  int64_t c_sb, c_sh, c_ss;
  const uint16_t* scale;  // float16 bits
  const uint16_t* zero;   // float16 bits; null for float8
  int64_t s_sb, s_sh, s_ss;  // scale / zero strides (same layout), s_ss per position or per block of `group`
  const float* tail;
  int64_t t_sb, t_sh, t_ss;
  int64_t nq;             // positions [0, nq) are quantized, [nq, n) are in the tail
  KvFormat format;
  int64_t group;
  bool per_channel;
};

struct QuantizedAttentionArgs {
  const float* q;
  int64_t B, Hq, Lq, D, q_sb, q_sh, q_sl;
  QuantizedSide k, v;
  int64_t Hkv, Dv;
  const uint8_t* mask_bool;  // at most one of mask_bool / mask_add; none: causal, query l at position n - Lq + l
  const float* mask_add;
  int64_t m_sb, m_sh, m_sl;
  float scale;
  int64_t n;
  float* out;
  int64_t o_sb, o_sh, o_sl;
  // Position splits per (item, chunk) (Note [Quantized KV attention split over positions]): 1, or S > 1 with
  // `partial` holding each split's rows as (running max, sum, Dv accumulators), combined by combine_splits.
  int64_t splits = 1;
  float* partial = nullptr;
};

// Keys per block of the online softmax, and query rows per work unit (Note [Quantized KV attention kernel]).
constexpr int64_t kKeyBlock = 16;
constexpr int64_t kQueryChunk = 32;
constexpr int64_t kTransposeRows = 8;  // from this many query rows per unit the K tile is transposed

// Work units of a call: per (b, kv head) item, its R = (Hq / Hkv) * Lq query rows in chunks of kQueryChunk.
inline int64_t query_chunks(const QuantizedAttentionArgs& p) {
  return ((p.Hq / p.Hkv) * p.Lq + kQueryChunk - 1) / kQueryChunk;
}

// Units [unit0, unit1) of [0, B * Hkv * query_chunks(p) * p.splits), unit = ((b * Hkv + kv head) * chunks + chunk) *
// splits + split; the glue splits them across threads, then (splits > 1) calls combine_splits.
void quantized_kv_attention(Isa isa, const QuantizedAttentionArgs& p, int64_t unit0, int64_t unit1);

// Floats of p.partial per work unit: its query rows' (max, sum, Dv accumulators).
inline int64_t partial_floats(const QuantizedAttentionArgs& p) { return kQueryChunk * (p.Dv + 2); }

// The outputs of items [item0, item1) (b * Hkv + kv head) from their splits' partial rows.
void combine_splits(const QuantizedAttentionArgs& p, int64_t item0, int64_t item1);

}  // namespace torchqkit_cpu
