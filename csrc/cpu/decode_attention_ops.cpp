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
#include "kernel_descriptions.h"

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

// A 4-d tensor as the kernels read it: fp32 with the last dim contiguous. A float32 tensor that already is one is
// read in place with its own strides (no new tensor: the decode step calls this op once per layer per token);
// others are converted, key and value only over the `rows` positions the kernel reads.
struct Rows {
  const float* data;
  int64_t s0, s1, s2;
  at::Tensor keep;  // the converted copy, when one was made
};

Rows fp32_rows(const at::Tensor& t, int64_t rows) {
  at::Tensor f = t;
  if (t.scalar_type() != at::kFloat || (t.stride(3) != 1 && t.size(3) > 1)) {
    f = t.narrow(2, 0, rows).to(at::kFloat).contiguous();
  }
  return {f.data_ptr<float>(), f.stride(0), f.stride(1), f.stride(2), f};
}

// The mask's strides broadcast to (B, Hq, Lq, S) (0 along a broadcast dim) and its data, bool or fp32 with the last
// dim contiguous (converted, or expanded and copied, only when it is not).
struct MaskView {
  int64_t s[4];
  at::Tensor t;
};

MaskView mask_view(const at::Tensor& mask, const int64_t (&shape)[4]) {
  MaskView m{{0, 0, 0, 0}, mask.scalar_type() == at::kBool ? mask : mask.to(at::kFloat)};
  for (int64_t i = 1; i <= m.t.dim(); ++i) m.s[4 - i] = m.t.size(-i) == 1 ? 0 : m.t.stride(-i);
  if (m.s[3] != 1 && shape[3] > 1) {  // a mask broadcast (or strided) along the key positions: rows made explicit
    m.t = m.t.expand(at::IntArrayRef(shape, 4)).contiguous();
    for (int i = 0; i < 4; ++i) m.s[i] = m.t.stride(i);
  }
  return m;
}

// What kernels.status() says serves the op at each level (Note [Kernel descriptions] in kernel_descriptions.cpp).
const DescribeOp kDescribed(
    OpDescription(kOp)
        .at("avx512_vnni",
            "AVX-512 (16 lanes): K / V rows up to the last visible position only, the query heads of a kv head in "
            "tiles of 4 rows, vectorized exp; bf16 / fp16 rows converted to fp32, float64 runs ATen's sdpa over the "
            "same positions (with a warning)")
        .at("avx2",
            "AVX2 + FMA (8 lanes), the AVX-512 kernel's source: K / V rows up to the last visible position only; "
            "bf16 / fp16 rows converted to fp32, float64 runs ATen's sdpa over the same positions (with a warning)")
        .at("scalar",
            "plain loops over K / V rows up to the last visible position (the CPU has no AVX2+FMA, or "
            "TORCHQKIT_CPU_ISA forced it)"));

}  // namespace

at::Tensor sdpa_over_filled_cache(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& attn_mask, double scale, bool enable_gqa) {
  check_inputs(query, key, value, attn_mask, enable_gqa);
  const int64_t B = query.size(0), Hq = query.size(1), Lq = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), Dv = value.size(3);
  // The fake (shapes only) is empty_like(query) when Dv == D: the same strides here, so compiled code that reads
  // the output (transposed back to (B, Lq, Hq, D) by the caller) sees what the fake promised.
  at::Tensor out = Dv == D ? at::empty_like(query) : at::empty({B, Hq, Lq, Dv}, query.options());

  const bool is_bool = attn_mask.scalar_type() == at::kBool;
  const int64_t shape[4] = {B, Hq, Lq, S};
  const MaskView mask = mask_view(attn_mask, shape);
  FilledAttentionArgs p{};
  p.B = B; p.Hq = Hq; p.Lq = Lq; p.D = D; p.Hkv = Hkv; p.Dv = Dv;
  p.mask_bool = is_bool ? reinterpret_cast<const uint8_t*>(mask.t.data_ptr<bool>()) : nullptr;
  p.mask_add = is_bool ? nullptr : mask.t.data_ptr<float>();
  p.m_sb = mask.s[0]; p.m_sh = mask.s[1]; p.m_sl = mask.s[2];
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

  const Rows q = fp32_rows(query, Lq), k = fp32_rows(key, n), v = fp32_rows(value, n);
  const bool direct = dt == at::kFloat && out.stride(-1) == 1;
  at::Tensor o = direct ? out : at::empty({B, Hq, Lq, Dv}, query.options().dtype(at::kFloat));
  p.q = q.data; p.q_sb = q.s0; p.q_sh = q.s1; p.q_sl = q.s2;
  p.k = k.data; p.k_sb = k.s0; p.k_sh = k.s1; p.k_ss = k.s2;
  p.v = v.data; p.v_sb = v.s0; p.v_sh = v.s1; p.v_ss = v.s2;
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
