// CPU backend of torchqkit::sdpa_quantized_kv_cache: argument checks, threads, ISA choice.
//
// The op (schema, fake, reference) is defined in torchqkit/kernels/ops/sdpa_quantized_kv_cache.py; the kernels are
// in quantized_kv_attention.cpp (Note [Quantized KV attention kernel]); registration.cpp registers this function.
// The kernel computes in float32: other query dtypes are converted on the way in and out.
#include <ATen/ATen.h>
#include "parallel.h"

#include <cstring>
#include <optional>
#include <string>

#include "kernel_descriptions.h"
#include "quantized_kv_attention.h"

namespace torchqkit_cpu {

namespace {

constexpr const char* kOp = "torchqkit::sdpa_quantized_kv_cache";
constexpr int64_t kParallelMinWork = 1 << 19;  // as sdpa_over_filled_cache: below it one thread does the call
// Note [Quantized KV attention split over positions] (quantized_kv_attention.cpp): splits when the units are fewer
// than this many per thread, each split at least kSplitMinPositions long.
constexpr int64_t kSplitUnitsPerThread = 4;
constexpr int64_t kSplitMinPositions = 256;

// S splits per unit: 1 where the units already fill the threads or the cache is short; else the smallest S that gives
// every thread kSplitUnitsPerThread units and divides the units evenly over the threads (within 2x of it).
int64_t position_splits(int64_t units, int64_t n, int64_t threads) {
  if (threads <= 1 || units >= kSplitUnitsPerThread * threads) return 1;
  const int64_t most = std::max<int64_t>(1, n / kSplitMinPositions);
  int64_t s = std::min(most, (kSplitUnitsPerThread * threads + units - 1) / units);
  for (int64_t t = s; t <= std::min(most, 2 * s); ++t)
    if ((units * t) % threads == 0) return t;
  return s;
}

KvFormat parse_format(const std::string& name, const char* side) {
  if (name == "int8") return KvFormat::kInt8;
  if (name == "int4") return KvFormat::kInt4;
  if (name == "float8_e4m3fn") return KvFormat::kFloat8E4M3;
  if (name == "float8_e5m2") return KvFormat::kFloat8E5M2;
  TORCH_CHECK(false, kOp, ": ", side, " format '", name, "' is not one of int8, int4, float8_e4m3fn, float8_e5m2");
}

// [n, nq] from a side's counts tensor (int64, 2 values on the CPU).
std::pair<int64_t, int64_t> read_counts(const at::Tensor& counts, const char* side) {
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.numel() == 2 && counts.device().is_cpu(), kOp, ": ", side,
              "_counts must be an int64 CPU tensor [length, quantized length], got ", counts.scalar_type(), " ",
              counts.sizes());
  const at::Tensor c = counts.contiguous();
  return {c.data_ptr<int64_t>()[0], c.data_ptr<int64_t>()[1]};
}

// One side's tensors checked against the shapes the layout promises, and their pointers / strides.
QuantizedSide side_view(const char* side, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                        const at::Tensor& tail, int64_t nq, int64_t n, const std::string& format, int64_t group,
                        bool per_channel, int64_t B, int64_t H, int64_t D) {
  QuantizedSide s{};
  s.format = parse_format(format, side);
  s.group = group;
  s.per_channel = per_channel;
  s.nq = nq;
  TORCH_CHECK(group > 0 && (per_channel || D % group == 0), kOp, ": ", side, " group ", group,
              " must be positive and divide the head dim ", D, " for per-token groups");
  const int64_t width = s.format == KvFormat::kInt4 ? (D + 1) / 2 : D;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.size(0) == B && codes.size(1) == H &&
                  codes.size(2) >= nq && codes.size(3) == width && codes.stride(3) == 1,
              kOp, ": ", side, "_codes must be uint8 (", B, ", ", H, ", >= ", nq, ", ", width,
              ") with a contiguous last dim, got ", codes.scalar_type(), " ", codes.sizes());
  const int64_t srows = per_channel ? (nq + group - 1) / group : nq, scols = per_channel ? D : D / group;
  const bool is_float8 = s.format == KvFormat::kFloat8E4M3 || s.format == KvFormat::kFloat8E5M2;
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 4 && scale.size(0) == B && scale.size(1) == H &&
                  scale.size(2) >= srows && scale.size(3) == scols && scale.stride(3) == 1,
              kOp, ": ", side, "_scale must be float16 (", B, ", ", H, ", >= ", srows, ", ", scols, "), got ",
              scale.scalar_type(), " ", scale.sizes());
  if (is_float8) {
    TORCH_CHECK(zero.numel() == 0, kOp, ": ", side, "_zero must be empty for float8 codes, got ", zero.sizes());
  } else {
    TORCH_CHECK(zero.sizes() == scale.sizes() && zero.strides() == scale.strides() &&
                    zero.scalar_type() == at::kHalf,
                kOp, ": ", side, "_zero must be float16 with the scale's shape and strides ", scale.sizes());
  }
  TORCH_CHECK(tail.scalar_type() == at::kFloat && tail.dim() == 4 && tail.size(0) == B && tail.size(1) == H &&
                  tail.size(2) >= n - nq && tail.size(3) == D && tail.stride(3) == 1,
              kOp, ": ", side, "_tail must be float32 (", B, ", ", H, ", >= ", n - nq, ", ", D, "), got ",
              tail.scalar_type(), " ", tail.sizes());
  s.codes = codes.data_ptr<uint8_t>();
  s.c_sb = codes.stride(0); s.c_sh = codes.stride(1); s.c_ss = codes.stride(2);
  s.scale = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  s.zero = is_float8 ? nullptr : reinterpret_cast<const uint16_t*>(zero.data_ptr<at::Half>());
  s.s_sb = scale.stride(0); s.s_sh = scale.stride(1); s.s_ss = scale.stride(2);
  s.tail = tail.data_ptr<float>();
  s.t_sb = tail.stride(0); s.t_sh = tail.stride(1); s.t_ss = tail.stride(2);
  return s;
}

const DescribeOp kDescribed(
    OpDescription(kOp)
        .at("avx512_vnni",
            "AVX-512 (compiler-vectorized loops and 16-lane vectors): K / V rows decoded 16 positions at a time into "
            "L1 tiles, scores as vector dots (decode) or FMAs across a transposed tile (8+ query rows), online "
            "softmax with a vectorized exp; int8 / int4 / float8 codes, per-token or per-channel scales")
        .at("avx2", "AVX2 + FMA, the AVX-512 kernel's source: 16-position tiles, online softmax, vectorized exp")
        .at("scalar", "the same loops without AVX (the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it)"));

}  // namespace

at::Tensor sdpa_quantized_kv_cache(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                   const at::Tensor& k_zero, const at::Tensor& k_tail, const at::Tensor& k_counts,
                                   const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                                   const at::Tensor& v_tail, const at::Tensor& v_counts,
                                   const std::optional<at::Tensor>& attn_mask, double scale, bool enable_gqa,
                                   std::string k_format, int64_t k_group, bool k_per_channel, std::string v_format,
                                   int64_t v_group) {
  TORCH_CHECK(query.dim() == 4 && at::isFloatingType(query.scalar_type()), kOp,
              ": query must be a floating (batch, heads, positions, head dim) tensor, got ", query.scalar_type(), " ",
              query.sizes());
  const int64_t B = query.size(0), Hq = query.size(1), Lq = query.size(2), D = query.size(3);
  const int64_t Hkv = k_tail.dim() == 4 ? k_tail.size(1) : 0, Dv = v_tail.dim() == 4 ? v_tail.size(3) : 0;
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, kOp, ": ", Hq, " query heads are not a multiple of ", Hkv, " kv heads");
  TORCH_CHECK(Hq == Hkv || enable_gqa, kOp, ": ", Hq, " query heads and ", Hkv,
              " kv heads need enable_gqa=True (grouped-query attention)");
  const auto [n, nqk] = read_counts(k_counts, "k");
  const auto [nv, nqv] = read_counts(v_counts, "v");
  TORCH_CHECK(n == nv && 0 <= nqk && nqk <= n && 0 <= nqv && nqv <= n, kOp, ": key counts [", n, ", ", nqk,
              "] and value counts [", nv, ", ", nqv, "] must hold one length and quantized lengths within it");
  TORCH_CHECK(n >= Lq, kOp, ": the cache holds ", n, " positions, fewer than the ", Lq, " queries");

  QuantizedAttentionArgs p{};
  p.k = side_view("k", k_codes, k_scale, k_zero, k_tail, nqk, n, k_format, k_group, k_per_channel, B, Hkv, D);
  p.v = side_view("v", v_codes, v_scale, v_zero, v_tail, nqv, n, v_format, v_group, false, B, Hkv, Dv);
  at::Tensor out = at::empty({B, Hq, Lq, Dv}, query.options());
  if (out.numel() == 0) return out;

  at::Tensor mask;
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK(m.dim() <= 4 && m.size(-1) >= n, kOp, ": attn_mask ", m.sizes(), " must cover the ", n,
                " cached positions in its last dim");
    mask = m.narrow(-1, 0, n);
    mask = (mask.scalar_type() == at::kBool ? mask : mask.to(at::kFloat)).expand({B, Hq, Lq, n});
    if (mask.stride(3) != 1 && n > 1) mask = mask.contiguous();
    p.m_sb = mask.stride(0);
    p.m_sh = mask.stride(1); p.m_sl = mask.stride(2);
    if (mask.scalar_type() == at::kBool) p.mask_bool = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
    else p.mask_add = mask.data_ptr<float>();
  }
  const at::Tensor q =
      query.scalar_type() == at::kFloat && query.stride(3) == 1 ? query : query.to(at::kFloat).contiguous();
  const bool direct = query.scalar_type() == at::kFloat;
  at::Tensor o = direct ? out : at::empty({B, Hq, Lq, Dv}, query.options().dtype(at::kFloat));
  p.q = q.data_ptr<float>(); p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_sl = q.stride(2);
  p.B = B; p.Hq = Hq; p.Lq = Lq; p.D = D; p.Hkv = Hkv; p.Dv = Dv;
  p.scale = static_cast<float>(scale);
  p.n = n;
  p.out = o.data_ptr<float>(); p.o_sb = o.stride(0); p.o_sh = o.stride(1); p.o_sl = o.stride(2);
  const Isa isa = selected_isa_exact();
  const int64_t chunks = query_chunks(p), units = B * Hkv * chunks;
  p.splits = position_splits(units, n, (int64_t)at::get_num_threads());
  at::Tensor partial;
  if (p.splits > 1) {
    partial = at::empty({units * p.splits * partial_floats(p)}, query.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
  }
  const int64_t work = std::max<int64_t>(1, std::min<int64_t>(kQueryChunk, (Hq / Hkv) * Lq) * n * (D + Dv) / p.splits);
  at::parallel_for(0, units * p.splits, std::max<int64_t>(1, kParallelMinWork / work), [&](int64_t u0, int64_t u1) {
    quantized_kv_attention(isa, p, u0, u1);
  });
  if (p.splits > 1) combine_splits(p, 0, B * Hkv);
  if (!direct) out.copy_(o);
  return out;
}

}  // namespace torchqkit_cpu
