// Plain-C++ interface between the ATen glue (decode_attention_ops.cpp) and the attention kernels
// (decode_attention.cpp) of torchqkit::sdpa_over_filled_cache: softmax(q k^T * scale + mask) v over the
// positions [0, n) of a static KV cache, n found from the mask. No torch header (see kernels.h).
//
// Shapes (the glue has broadcast the mask and checked everything):
//   q    (B, Hq, Lq, D)   fp32, last dim contiguous, strides q_sb / q_sh / q_sl
//   k    (B, Hkv, S, D)   fp32, last dim contiguous, strides k_sb / k_sh / k_ss   (only rows [0, n) are read)
//   v    (B, Hkv, S, Dv)  fp32, last dim contiguous, strides v_sb / v_sh / v_ss
//   mask (B, Hq, Lq, S)   bool (uint8 0/1) or additive fp32, last dim contiguous, strides m_sb / m_sh / m_sl
//                         (0 where the mask broadcasts)
//   out  (B, Hq, Lq, Dv)  fp32, last dim contiguous, strides o_sb / o_sh / o_sl
// Query head h reads K/V head h / (Hq / Hkv) (grouped-query attention).
#pragma once
#include <cstdint>

#include "kernels.h"

namespace torchqkit_cpu {

struct FilledAttentionArgs {
  const float* q;
  int64_t B, Hq, Lq, D, q_sb, q_sh, q_sl;
  const float* k;
  int64_t Hkv, k_sb, k_sh, k_ss;
  const float* v;
  int64_t Dv, v_sb, v_sh, v_ss;
  const uint8_t* mask_bool;  // exactly one of mask_bool / mask_add is set
  const float* mask_add;
  int64_t m_sb, m_sh, m_sl;
  float scale;
  int64_t n;                 // positions read: [0, n), from last_visible_count
  float* out;
  int64_t o_sb, o_sh, o_sl;
};

// One more than the last key position that any (b, h, l) row of the mask lets its query see: visible means
// true (bool mask) or greater than `hidden` (additive mask: the mask dtype's lowest value, which transformers
// writes where a position is masked; -inf is below it). 0 when no position is visible. Rows repeated by a
// stride-0 (broadcast) dimension are scanned once; each row is scanned backwards and only above the count
// found so far, so a mask over a mostly empty cache costs about one pass over its unfilled tail.
int64_t last_visible_count(const FilledAttentionArgs& p, int64_t S, float hidden);

// Work items are (b, kv head) pairs, item = b * Hkv + kv head: every query head of the group and every query
// row is computed from one read of that head's K and V rows [0, n). The glue splits [0, B * Hkv) across threads.
void filled_attention(Isa isa, const FilledAttentionArgs& p, int64_t item0, int64_t item1);

}  // namespace torchqkit_cpu
