// CPU backend of torchqkit::sdpa_over_filled_cache: argument checks, dtype plumbing, threads, ISA choice.
//
// The op (schema, fake, reference) is defined in torchqkit/kernels/ops/sdpa_over_filled_cache.py; the kernels
// are in decode_attention.cpp (Note [Filled-cache attention kernel]); registration.cpp registers this function.
// float32 / bfloat16 / float16 run the C++ kernel (bf16 / fp16 K and V rows [0, n) converted to fp32 first);
// float64 runs ATen's sdpa over the same filled positions, with a warning saying so.
#include <ATen/ATen.h>
#include "parallel.h"

#include <limits>

#include "decode_attention.h"

namespace torchqkit_cpu {

namespace {

constexpr const char* kOp = "torchqkit::sdpa_over_filled_cache";
// Multiply-adds (query rows x positions x (D + Dv)) from which a call splits its (batch, kv head) items across
// threads: below it the fork / join of the thread pool costs more than the work (SmolLM2 decode at n ~ 50 is
// ~20 K per kv head, one thread).
constexpr int64_t kParallelMinWork = 1 << 19;

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  bool enable_gqa) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kOp, ": query, key and value must be 4-d (batch, heads, "
              "positions, head dim), got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
              kOp, ": key ", k.sizes(), " and value ", v.sizes(), " must be (batch, kv heads, positions, .) with the "
              "query's batch ", q.size(0));
  TORCH_CHECK(k.size(3) == q.size(3), kOp, ": key head dim ", k.size(3), " != query head dim ", q.size(3));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, kOp, ": ", q.size(1), " query heads are not a multiple of ",
              k.size(1), " key / value heads");
  TORCH_CHECK(q.size(1) == k.size(1) || enable_gqa, kOp, ": ", q.size(1), " query heads and ", k.size(1),
              " key / value heads need enable_gqa=True (grouped-query attention)");
  const auto dt = q.scalar_type();
  TORCH_CHECK(at::isFloatingType(dt) && k.scalar_type() == dt && v.scalar_type() == dt, kOp,
              ": query, key and value must have one floating dtype, got ", dt, ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()), kOp,
              ": attn_mask must be bool or an additive floating mask, got ", mask.scalar_type());
  const int64_t want[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
  bool ok = mask.dim() <= 4;
  for (int64_t i = 1; ok && i <= mask.dim(); ++i)
    ok = mask.size(-i) == 1 || mask.size(-i) == want[4 - i];
  TORCH_CHECK(ok, kOp, ": attn_mask of shape ", mask.sizes(), " does not broadcast to (batch, query heads, query "
              "positions, key positions) = ", at::IntArrayRef(want, 4));
}

// The additive mask's "hidden" value: the lowest finite value of its dtype (transformers' masked entries).
float hidden_value(at::ScalarType dt) {
  float hidden = 0.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "hidden_value", [&] {
    hidden = static_cast<float>(std::numeric_limits<scalar_t>::lowest());
  });
  return hidden;
}

// Last dim contiguous (the kernels' one requirement on strides), fp32.
at::Tensor fp32_rows(const at::Tensor& t) {
  const at::Tensor f = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  return f.stride(-1) == 1 || f.size(-1) <= 1 ? f : f.contiguous();
}

}  // namespace

at::Tensor sdpa_over_filled_cache(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& attn_mask, double scale, bool enable_gqa) {
  check_inputs(query, key, value, attn_mask, enable_gqa);
  const int64_t B = query.size(0), Hq = query.size(1), Lq = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), Dv = value.size(3);
  // The fake (shapes only) is empty_like(query) when Dv == D: the same strides here, so compiled code that reads
  // the output (transposed back to (B, Lq, Hq, D) by the caller) sees what the fake promised.
  at::Tensor out = Dv == D ? at::empty_like(query) : at::empty({B, Hq, Lq, Dv}, query.options());

  // The mask as the kernels read it: bool, or fp32 converted before broadcasting (no full-size copy).
  const bool is_bool = attn_mask.scalar_type() == at::kBool;
  at::Tensor mask = (is_bool ? attn_mask : attn_mask.to(at::kFloat)).expand({B, Hq, Lq, S});
  if (mask.stride(3) != 1 && S > 1) mask = mask.contiguous();
  FilledAttentionArgs p{};
  p.B = B; p.Hq = Hq; p.Lq = Lq; p.D = D; p.Hkv = Hkv; p.Dv = Dv;
  p.mask_bool = is_bool ? reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()) : nullptr;
  p.mask_add = is_bool ? nullptr : mask.data_ptr<float>();
  p.m_sb = mask.stride(0); p.m_sh = mask.stride(1); p.m_sl = mask.stride(2);
  if (out.numel() == 0) return out;
  const int64_t visible = S > 0 ? last_visible_count(p, S, is_bool ? 0.f : hidden_value(attn_mask.scalar_type())) : 0;
  // No visible position at all: every key position takes part (as the reference does), and sdpa's rules decide.
  const int64_t n = visible > 0 ? visible : S;

  const auto dt = query.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) {
    TORCH_WARN_ONCE(kOp, ": ", dt, " inputs run ATen's scaled_dot_product_attention over the filled positions, not "
                    "the C++ kernel (which takes float32, bfloat16 and float16)");
    out.copy_(at::scaled_dot_product_attention(query, key.narrow(2, 0, n), value.narrow(2, 0, n),
                                               attn_mask.expand({B, Hq, Lq, S}).narrow(3, 0, n), 0.0, false, scale,
                                               enable_gqa));
    return out;
  }

  const at::Tensor q = fp32_rows(query), k = fp32_rows(key.narrow(2, 0, n)), v = fp32_rows(value.narrow(2, 0, n));
  const bool direct = dt == at::kFloat && out.stride(-1) == 1;
  at::Tensor o = direct ? out : at::empty({B, Hq, Lq, Dv}, q.options());
  p.q = q.data_ptr<float>(); p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_sl = q.stride(2);
  p.k = k.data_ptr<float>(); p.k_sb = k.stride(0); p.k_sh = k.stride(1); p.k_ss = k.stride(2);
  p.v = v.data_ptr<float>(); p.v_sb = v.stride(0); p.v_sh = v.stride(1); p.v_ss = v.stride(2);
  p.out = o.data_ptr<float>(); p.o_sb = o.stride(0); p.o_sh = o.stride(1); p.o_sl = o.stride(2);
  p.scale = static_cast<float>(scale);
  p.n = n;
  const Isa isa = selected_isa_exact();
  const int64_t work = std::max<int64_t>(1, (Hq / Hkv) * Lq * n * (D + Dv));
  at::parallel_for(0, B * Hkv, std::max<int64_t>(1, kParallelMinWork / work), [&](int64_t i0, int64_t i1) {
    filled_attention(isa, p, i0, i1);
  });
  if (!direct) out.copy_(o);
  return out;
}

}  // namespace torchqkit_cpu
