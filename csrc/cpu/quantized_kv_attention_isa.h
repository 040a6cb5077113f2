// The kernel of torchqkit::sdpa_quantized_kv_cache written once in plain loops that the compiler vectorizes at the
// width of the ISA region it is included in (quantized_kv_attention.cpp: scalar, AVX2 + FMA, AVX-512).
// See Note [Quantized KV attention kernel] in quantized_kv_attention.cpp.

// Float scales (and zeros) of the scale row a position reads: converted from float16 once per row of scales (per
// channel a row serves `group` positions, per token one position).
struct ScaleRow {
  int64_t row = -1;
  float* scale;
  float* zero;
};

// Row j of one side, D floats into `out`: the tail row copied, or its codes decoded and scaled.
inline void decode_row(const QuantizedSide& s, int64_t b, int64_t h, int64_t j, int64_t D, float* out, ScaleRow& sr) {
  if (j >= s.nq) {
    std::memcpy(out, s.tail + b * s.t_sb + h * s.t_sh + (j - s.nq) * s.t_ss, sizeof(float) * D);
    return;
  }
  const uint8_t* c = s.codes + b * s.c_sb + h * s.c_sh + j * s.c_ss;
  const int64_t srow = s.per_channel ? j / s.group : j;
  if (srow != sr.row) {
    const int64_t width = s.per_channel ? D : D / s.group;
    const uint16_t* sc = s.scale + b * s.s_sb + h * s.s_sh + srow * s.s_ss;
    const uint16_t* zp = s.zero ? s.zero + b * s.s_sb + h * s.s_sh + srow * s.s_ss : nullptr;
    for (int64_t i = 0; i < width; ++i) {
      sr.scale[i] = half_to_float(sc[i]);
      sr.zero[i] = zp ? half_to_float(zp[i]) : 0.f;
    }
    sr.row = srow;
  }
  // ---- codes to floats (int4: unpack the two nibbles of each byte first)
  switch (s.format) {
    case KvFormat::kInt8:
      for (int64_t d = 0; d < D; ++d) out[d] = (float)c[d] - 128.f;
      break;
    case KvFormat::kInt4:
      for (int64_t i = 0; i < D / 2; ++i) {
        out[2 * i] = (float)(c[i] & 15) - 8.f;
        out[2 * i + 1] = (float)(c[i] >> 4) - 8.f;
      }
      if (D & 1) out[D - 1] = (float)(c[D / 2] & 15) - 8.f;
      break;
    case KvFormat::kFloat8E4M3:
      for (int64_t d = 0; d < D; ++d) out[d] = kFloat8E4M3Table[c[d]];
      break;
    case KvFormat::kFloat8E5M2:
      for (int64_t d = 0; d < D; ++d) out[d] = kFloat8E5M2Table[c[d]];
      break;
  }
  // ---- scale and zero: per channel one per element, per token one per group of `group` elements
  const float* sc = sr.scale;
  const float* zp = sr.zero;
  if (s.per_channel) {
    for (int64_t d = 0; d < D; ++d) out[d] = out[d] * sc[d] + zp[d];
  } else {
    for (int64_t g0 = 0, gi = 0; g0 < D; g0 += s.group, ++gi) {
      const int64_t g1 = std::min(D, g0 + s.group);
      const float a = sc[gi], z = zp[gi];
      for (int64_t d = g0; d < g1; ++d) out[d] = out[d] * a + z;
    }
  }
}

// kKeyBlock floats (one per key of a block) as a GCC vector: one zmm in the AVX-512 region, two ymm in the AVX2 one,
// scalar code in the scalar one. Unaligned: the scratch is a float vector.
typedef float keys_f __attribute__((vector_size(kKeyBlock * sizeof(float)), aligned(4), may_alias));
typedef int32_t keys_i __attribute__((vector_size(kKeyBlock * sizeof(float)), aligned(4), may_alias));

// e^x for x <= 0, lane by lane, in vector arithmetic (std::exp is a libm call per element): x = k ln 2 + r with
// k = round(x / ln 2) (the 1.5 * 2^23 shift rounds to nearest and leaves k in the low mantissa bits), ln 2 split in
// two for an exact r, e^r by its degree-6 Taylor polynomial (|r| <= ln 2 / 2: relative error < 2e-7), times 2^k
// built in the exponent bits. Lanes at or below -87 (e^x < 2^-125), -inf (hidden positions) and NaN give 0.
inline keys_f exp_nonpositive(keys_f x) {
  const keys_i keep = x > (keys_f{} - 87.f);
  x = keep ? x : keys_f{};
  const keys_f shifted = x * 1.44269504f + 12582912.f;
  const keys_f k = shifted - 12582912.f;
  const keys_f r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  keys_f e = keys_f{} + 1.f / 720.f;
  e = e * r + 1.f / 120.f;
  e = e * r + 1.f / 24.f;
  e = e * r + 1.f / 6.f;
  e = e * r + 0.5f;
  e = e * r + 1.f;
  e = e * r + 1.f;
  const keys_i pow2 = ((keys_i)shifted - 0x4B400000 + 127) << 23;
  return keep ? e * (keys_f)pow2 : keys_f{};
}

inline float lane_max(keys_f v) {
  float m = v[0];
  for (int64_t c = 1; c < kKeyBlock; ++c) m = std::max(m, v[c]);
  return m;
}

inline float lane_sum(keys_f v) {
  float t = 0.f;
  for (int64_t c = 0; c < kKeyBlock; ++c) t += v[c];
  return t;
}

// The kKeyBlock scores of query row q against K rows kr (row-major kKeyBlock x D): one vector dot per key (few
// query rows: decode) ...
inline keys_f scores_by_rows(const float* q, const float* kr, int64_t D) {
  keys_f s;
  for (int64_t c = 0; c < kKeyBlock; ++c) {
    const float* k = kr + c * D;
    float x = 0.f;
#pragma omp simd reduction(+ : x)
    for (int64_t d = 0; d < D; ++d) x += q[d] * k[d];
    s[c] = x;
  }
  return s;
}

// ... or vector FMAs across the keys of the transposed tile kt (D x kKeyBlock), no horizontal sums (many rows).
inline keys_f scores_by_columns(const float* q, const float* kt, int64_t D) {
  keys_f s{};
  for (int64_t d = 0; d < D; ++d) s += q[d] * *reinterpret_cast<const keys_f*>(kt + d * kKeyBlock);
  return s;
}

// Query rows [r0, r0 + rb) of item (b, kv head) over all n positions, kKeyBlock keys at a time with an online
// softmax (Note [Quantized KV attention kernel]).
inline void attend_rows(const QuantizedAttentionArgs& p, int64_t b, int64_t kvh, int64_t r0, int64_t rb,
                        float* scratch) {
  constexpr int64_t KB = kKeyBlock;
  const int64_t G = p.Hq / p.Hkv, n = p.n, D = p.D, Dv = p.Dv;
  const bool transpose = rb >= kTransposeRows;
  float* kr = scratch;                  // KB x D decoded K rows
  float* kt = kr + KB * D;              // D x KB, the same transposed (many rows)
  float* vt = kt + D * KB;              // KB x Dv decoded V rows
  float* acc = vt + KB * Dv;            // rb x Dv
  float* mx = acc + rb * Dv;            // rb running maxima
  float* sum = mx + rb;                 // rb running sums of e^(s - max)
  ScaleRow ks{-1, sum + rb, sum + rb + D}, vs{-1, sum + rb + 2 * D, sum + rb + 2 * D + Dv};
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rb; ++r) {
    mx[r] = kNegInf;
    sum[r] = 0.f;
    for (int64_t d = 0; d < Dv; ++d) acc[r * Dv + d] = 0.f;
  }
  keys_i lane;
  for (int64_t c = 0; c < KB; ++c) lane[c] = (int32_t)c;
  // Without a mask the queries are causal: no row of this chunk sees past its last query's position.
  const bool masked = p.mask_bool || p.mask_add;
  const int64_t first_l = r0 % p.Lq, last_l = (r0 + rb - 1) % p.Lq;
  const int64_t max_l = (rb >= p.Lq || last_l < first_l) ? p.Lq - 1 : last_l;  // rows may wrap to the next head
  const int64_t seen = masked ? n : n - p.Lq + max_l + 1;
  for (int64_t j0 = 0; j0 < seen; j0 += KB) {
    const int64_t jb = std::min(KB, n - j0);
    for (int64_t c = 0; c < jb; ++c) {
      decode_row(p.k, b, kvh, j0 + c, D, kr + c * D, ks);
      decode_row(p.v, b, kvh, j0 + c, Dv, vt + c * Dv, vs);
    }
    for (int64_t c = jb; c < KB; ++c)
      for (int64_t d = 0; d < D; ++d) kr[c * D + d] = 0.f;
    if (transpose)
      for (int64_t c = 0; c < KB; ++c)
        for (int64_t d = 0; d < D; ++d) kt[d * KB + c] = kr[c * D + d];
    for (int64_t r = r0; r < r0 + rb; ++r) {
      const int64_t h = kvh * G + r / p.Lq, l = r % p.Lq;
      const float* q = p.q + b * p.q_sb + h * p.q_sh + l * p.q_sl;
      keys_f s = (transpose ? scores_by_columns(q, kt, D) : scores_by_rows(q, kr, D)) * p.scale;
      if (masked) {
        const int64_t moff = b * p.m_sb + h * p.m_sh + l * p.m_sl + j0;
        keys_f add;
        for (int64_t c = 0; c < KB; ++c)
          add[c] = c >= jb ? kNegInf : p.mask_bool ? (p.mask_bool[moff + c] ? 0.f : kNegInf) : p.mask_add[moff + c];
        s += add;
      } else {  // causal: query l sits at position n - Lq + l; lanes past n hidden too
        const int32_t limit = (int32_t)(std::min(n - p.Lq + l, j0 + jb - 1) - j0);
        s = lane > limit ? keys_f{} + kNegInf : s;
      }
      const float bm = lane_max(s);
      if (bm == kNegInf) continue;  // nothing visible in this block for this row
      const int64_t i = r - r0;
      const float m_new = std::max(mx[i], bm);
      const float factor = exp_nonpositive(keys_f{} + (mx[i] - m_new))[0];  // 0 while nothing was visible before
      const keys_f w = exp_nonpositive(s - m_new);
      float* ar = acc + i * Dv;
      if (factor != 1.f)
        for (int64_t d = 0; d < Dv; ++d) ar[d] *= factor;
      sum[i] = sum[i] * factor + lane_sum(w);
      mx[i] = m_new;
      for (int64_t c = 0; c < jb; ++c) {
        const float wc = w[c];
        const float* vc = vt + c * Dv;
#pragma GCC ivdep
        for (int64_t d = 0; d < Dv; ++d) ar[d] += wc * vc[d];
      }
    }
  }
  for (int64_t r = r0; r < r0 + rb; ++r) {
    const int64_t h = kvh * G + r / p.Lq, l = r % p.Lq, i = r - r0;
    float* o = p.out + b * p.o_sb + h * p.o_sh + l * p.o_sl;
    const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;  // a row that sees nothing: output 0 (as sdpa)
    for (int64_t d = 0; d < Dv; ++d) o[d] = acc[i * Dv + d] * inv;
  }
}

// Work units [unit0, unit1): unit = item * chunks + chunk, item = b * Hkv + kv head, chunk = kQueryChunk of the
// R = G * Lq query rows of that kv head (quantized_kv_attention.h).
inline void attend_units(const QuantizedAttentionArgs& p, int64_t unit0, int64_t unit1, float* scratch) {
  const int64_t R = (p.Hq / p.Hkv) * p.Lq, chunks = query_chunks(p);
  for (int64_t unit = unit0; unit < unit1; ++unit) {
    const int64_t item = unit / chunks, r0 = (unit % chunks) * kQueryChunk;
    attend_rows(p, item / p.Hkv, item % p.Hkv, r0, std::min(kQueryChunk, R - r0), scratch);
  }
}
