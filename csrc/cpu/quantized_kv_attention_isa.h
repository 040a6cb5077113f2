// The kernel of torchqkit::sdpa_quantized_kv_cache written once in plain loops that the compiler vectorizes at the
// width of the ISA region it is included in (quantized_kv_attention.cpp: scalar, AVX2 + FMA, AVX-512).
// See Note [Quantized KV attention kernel] in quantized_kv_attention.cpp.

// Float scales (and zeros) of the scale row a position reads: converted from float16 once per row of scales (per
// channel a row serves `group` positions, per token one position).
struct ScaleRow {
  int64_t row = -1;
  float* scale;  // the row's scales (D per channel, D / group per token)
  float* zero;
};

// Elements [d0, d1) of a codes row into out[d0, d1): (code - mid) * scale + zero (float8: value * scale), with a
// scale and zero per element (sc, zp) or, when sc is null, the same `a` and `z` for all of them.
__attribute__((always_inline)) inline void decode_span(KvFormat format, const uint8_t* c, int64_t d0, int64_t d1,
                                                       const float* sc, const float* zp, float* out, float a = 0.f,
                                                       float z = 0.f) {
#define TORCHQKIT_KV_DECODE(VALUE)                                              \
  if (sc) {                                                                     \
    for (int64_t d = d0; d < d1; ++d) out[d] = (VALUE) * sc[d] + zp[d];         \
  } else {                                                                      \
    for (int64_t d = d0; d < d1; ++d) out[d] = (VALUE) * a + z;                 \
  }
  switch (format) {
    case KvFormat::kInt8:
      TORCHQKIT_KV_DECODE((float)c[d] - 128.f)
      break;
    case KvFormat::kInt4: {  // pairs of elements from whole bytes (an odd start or end element alone)
      int64_t d = d0;
      const auto one = [&](int64_t e, float code) { out[e] = code * (sc ? sc[e] : a) + (sc ? zp[e] : z); };
      if (d & 1) one(d, (float)(c[d >> 1] >> 4) - 8.f), ++d;
      const int64_t pairs = (d1 - d) / 2;
      const uint8_t* cb = c + (d >> 1);
      float* o = out + d;
      if (sc) {
        const float* s2 = sc + d;
        const float* z2 = zp + d;
        for (int64_t i = 0; i < pairs; ++i) {
          o[2 * i] = ((float)(cb[i] & 15) - 8.f) * s2[2 * i] + z2[2 * i];
          o[2 * i + 1] = ((float)(cb[i] >> 4) - 8.f) * s2[2 * i + 1] + z2[2 * i + 1];
        }
      } else {
        for (int64_t i = 0; i < pairs; ++i) {
          o[2 * i] = ((float)(cb[i] & 15) - 8.f) * a + z;
          o[2 * i + 1] = ((float)(cb[i] >> 4) - 8.f) * a + z;
        }
      }
      d += 2 * pairs;
      if (d < d1) one(d, (float)(c[d >> 1] & 15) - 8.f);
      break;
    }
    case KvFormat::kFloat8E4M3:
      TORCHQKIT_KV_DECODE(kFloat8E4M3Table[c[d]])
      break;
    case KvFormat::kFloat8E5M2:
      TORCHQKIT_KV_DECODE(kFloat8E5M2Table[c[d]])
      break;
  }
#undef TORCHQKIT_KV_DECODE
}

// Row j of one side, D floats into `out`: the tail row copied, or its codes decoded and scaled.
__attribute__((always_inline)) inline void decode_row(const QuantizedSide& s, int64_t b, int64_t h, int64_t j,
                                                      int64_t D, float* out, ScaleRow& sr) {
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
  // ---- codes to floats, times the scale, plus the zero, in one pass over the row: per channel one scale per
  // element, per token one per group of `group` elements
  if (s.per_channel) {
    decode_span(s.format, c, 0, D, sr.scale, sr.zero, out);
  } else {
    for (int64_t g0 = 0, gi = 0; g0 < D; g0 += s.group, ++gi)
      decode_span(s.format, c, g0, std::min(D, g0 + s.group), nullptr, nullptr, out, sr.scale[gi], sr.zero[gi]);
  }
}

// Rows [j0, j0 + jb) of one side into out (row c at out + c * D): decode_row's result, with what rows of a block
// share done once per block (a decode step's K and V rows are 64 floats, so per-row overhead, the division finding
// the scale row and the call itself, cost as much as the decoding): the scale row found once for per-channel groups
// that hold whole blocks, the codes' row pointer stepped instead of recomputed.
inline void decode_block(const QuantizedSide& s, int64_t b, int64_t h, int64_t j0, int64_t jb, int64_t D, float* out,
                         ScaleRow& sr) {
  const int64_t quantized = std::max<int64_t>(0, std::min(jb, s.nq - j0));
  if (quantized > 0 && s.per_channel && s.group % kKeyBlock == 0) {
    decode_row(s, b, h, j0, D, out, sr);  // converts the block's one scale row
    const uint8_t* c = s.codes + b * s.c_sb + h * s.c_sh + j0 * s.c_ss;
    for (int64_t r = 1; r < quantized; ++r) decode_span(s.format, c + r * s.c_ss, 0, D, sr.scale, sr.zero, out + r * D);
  } else {
    for (int64_t r = 0; r < quantized; ++r) decode_row(s, b, h, j0 + r, D, out + r * D, sr);
  }
  for (int64_t r = quantized; r < jb; ++r) decode_row(s, b, h, j0 + r, D, out + r * D, sr);
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

typedef int32_t keys_lanes __attribute__((vector_size(kKeyBlock * sizeof(float))));  // shuffle indices

// Lane-wise maximum / sum of one vector by halving shuffles (a serial loop over lanes is a chain of 15 scalar ops).
inline float lane_max(keys_f v) {
  static_assert(kKeyBlock == 16, "the halving shuffles below are written for 16 lanes");
  if constexpr (!kLaneShuffles) {
    float m = v[0];
    for (int c = 1; c < 16; ++c) m = std::max(m, v[c]);
    return m;
  }
  const keys_lanes h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const keys_lanes h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const keys_lanes h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const keys_lanes h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  keys_f w = __builtin_shuffle(v, h8);
  v = v > w ? v : w;
  w = __builtin_shuffle(v, h4);
  v = v > w ? v : w;
  w = __builtin_shuffle(v, h2);
  v = v > w ? v : w;
  w = __builtin_shuffle(v, h1);
  v = v > w ? v : w;
  return v[0];
}

inline float lane_sum(keys_f v) {
  if constexpr (!kLaneShuffles) {
    float t = 0.f;
    for (int c = 0; c < 16; ++c) t += v[c];
    return t;
  }
  const keys_lanes h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const keys_lanes h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const keys_lanes h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const keys_lanes h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  v += __builtin_shuffle(v, h8);
  v += __builtin_shuffle(v, h4);
  v += __builtin_shuffle(v, h2);
  v += __builtin_shuffle(v, h1);
  return v[0];
}

// u and v folded: the lanes `lo` picks from (u, v) plus the lanes `hi` picks (__builtin_shuffle indices 0..31).
inline keys_f fold(keys_f u, keys_f v, keys_lanes lo, keys_lanes hi) {
  return __builtin_shuffle(u, v, lo) + __builtin_shuffle(u, v, hi);
}

// The kKeyBlock scores of query row q against K rows kr (row-major kKeyBlock x D) with few query rows (decode):
// per key a vector of 16 partial sums of its dot, then the 16 vectors summed lane-wise into one by a tree of
// shuffles (each level adds halves of two vectors: 15 folds instead of 16 horizontal sums, which GCC emits as a
// serial chain of scalar adds). Fed in bit-reversed order, the tree leaves key c's score in lane c.
inline keys_f scores_by_rows(const float* q, const float* kr, int64_t D) {
  static_assert(kKeyBlock == 16, "the fold tree below is written for 16 keys of 16 lanes");
  constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  const int64_t D16 = D & ~int64_t(15);
  if constexpr (!kLaneShuffles) {  // one reduced dot per key
    keys_f s;
    for (int c = 0; c < 16; ++c) {
      const float* k = kr + c * D;
      float x = 0.f;
#pragma omp simd reduction(+ : x)
      for (int64_t d = 0; d < D; ++d) x += q[d] * k[d];
      s[c] = x;
    }
    return s;
  }
  keys_f part[16];
  _Pragma("GCC unroll 16") for (int c = 0; c < 16; ++c) {
    const float* k = kr + c * D;
    keys_f acc{};
    for (int64_t d = 0; d < D16; d += 16)
      acc += *reinterpret_cast<const keys_f*>(q + d) * *reinterpret_cast<const keys_f*>(k + d);
    float rest = 0.f;
    for (int64_t d = D16; d < D; ++d) rest += q[d] * k[d];
    acc[0] += rest;
    part[kBitReversed[c]] = acc;
  }
  const keys_lanes lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const keys_lanes hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const keys_lanes lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const keys_lanes hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const keys_lanes lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const keys_lanes hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const keys_lanes lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const keys_lanes hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  keys_f l8[8], l4[4], l2[2];
  _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) l8[i] = fold(part[2 * i], part[2 * i + 1], lo8, hi8);
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) l4[i] = fold(l8[2 * i], l8[2 * i + 1], lo4, hi4);
  _Pragma("GCC unroll 2") for (int i = 0; i < 2; ++i) l2[i] = fold(l4[2 * i], l4[2 * i + 1], lo2, hi2);
  return fold(l2[0], l2[1], lo1, hi1);
}

// ... or vector FMAs across the keys of the transposed tile kt (D x kKeyBlock), no horizontal sums (many rows).
inline keys_f scores_by_columns(const float* q, const float* kt, int64_t D) {
  keys_f s{};
  for (int64_t d = 0; d < D; ++d) s += q[d] * *reinterpret_cast<const keys_f*>(kt + d * kKeyBlock);
  return s;
}

// acc (Dv floats) = acc * factor + sum over the block's jb keys of w[c] * V row c (vt: kKeyBlock x Dv), 16 values
// of acc at a time held in a register across the keys.
inline void accumulate_values(float* acc, float factor, keys_f w, const float* vt, int64_t jb, int64_t Dv) {
  const int64_t D16 = Dv & ~int64_t(15);
  for (int64_t d = 0; d < D16; d += 16) {
    keys_f a = *reinterpret_cast<const keys_f*>(acc + d) * factor;
    for (int64_t c = 0; c < jb; ++c) a += w[c] * *reinterpret_cast<const keys_f*>(vt + c * Dv + d);
    *reinterpret_cast<keys_f*>(acc + d) = a;
  }
  for (int64_t d = D16; d < Dv; ++d) {
    float a = acc[d] * factor;
    for (int64_t c = 0; c < jb; ++c) a += w[c] * vt[c * Dv + d];
    acc[d] = a;
  }
}

// Query rows [r0, r0 + rb) of item (b, kv head) over the positions of split `split` of p.splits (all n when 1),
// kKeyBlock keys at a time with an online softmax (Note [Quantized KV attention kernel]); a split's rows go to
// `partial` unnormalized, with their maxima and sums (Note [Quantized KV attention split over positions]).
inline void attend_rows(const QuantizedAttentionArgs& p, int64_t b, int64_t kvh, int64_t r0, int64_t rb,
                        int64_t split, float* partial, float* scratch) {
  constexpr int64_t KB = kKeyBlock;
  const int64_t G = p.Hq / p.Hkv, n = p.n, D = p.D, Dv = p.Dv;
  const bool transpose = rb >= kTransposeRows;
  float* kr = scratch;                  // KB x D decoded K rows
  float* kt = kr + KB * D;              // D x KB, the same transposed (many rows)
  float* vt = kt + D * KB;              // KB x Dv decoded V rows
  float* acc = vt + KB * Dv;            // rb x Dv
  float* mx = acc + rb * Dv;            // rb running maxima
  float* sum = mx + rb;                 // rb running sums of e^(s - max)
  float* conv = sum + rb;  // the two sides' converted scale rows: 2 x D (keys), 2 x Dv (values)
  ScaleRow ks{-1, conv, conv + D}, vs{-1, conv + 2 * D, conv + 2 * D + Dv};
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
  // This split's positions: whole key blocks, the last split the rest.
  const int64_t per_split = (seen + p.splits * KB - 1) / (p.splits * KB) * KB;
  const int64_t j_begin = split * per_split, j_end = std::min(seen, j_begin + per_split);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += KB) {
    const int64_t jb = std::min(KB, n - j0);
    decode_block(p.k, b, kvh, j0, jb, D, kr, ks);
    decode_block(p.v, b, kvh, j0, jb, Dv, vt, vs);
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
      sum[i] = sum[i] * factor + lane_sum(w);
      mx[i] = m_new;
      accumulate_values(acc + i * Dv, factor, w, vt, jb, Dv);
    }
  }
  if (partial) {
    for (int64_t i = 0; i < rb; ++i) {
      float* row = partial + i * (Dv + 2);
      row[0] = mx[i];
      row[1] = sum[i];
      for (int64_t d = 0; d < Dv; ++d) row[2 + d] = acc[i * Dv + d];
    }
    return;
  }
  for (int64_t r = r0; r < r0 + rb; ++r) {
    const int64_t h = kvh * G + r / p.Lq, l = r % p.Lq, i = r - r0;
    float* o = p.out + b * p.o_sb + h * p.o_sh + l * p.o_sl;
    const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;  // a row that sees nothing: output 0 (as sdpa)
    for (int64_t d = 0; d < Dv; ++d) o[d] = acc[i * Dv + d] * inv;
  }
}

// Work units [unit0, unit1): unit = (item * chunks + chunk) * splits + split, item = b * Hkv + kv head, chunk =
// kQueryChunk of the R = G * Lq query rows of that kv head (quantized_kv_attention.h).
inline void attend_units(const QuantizedAttentionArgs& p, int64_t unit0, int64_t unit1, float* scratch) {
  const int64_t R = (p.Hq / p.Hkv) * p.Lq, chunks = query_chunks(p);
  for (int64_t unit = unit0; unit < unit1; ++unit) {
    const int64_t split = unit % p.splits, piece = unit / p.splits;
    const int64_t item = piece / chunks, r0 = (piece % chunks) * kQueryChunk;
    float* partial = p.splits > 1 ? p.partial + unit * partial_floats(p) : nullptr;
    attend_rows(p, item / p.Hkv, item % p.Hkv, r0, std::min(kQueryChunk, R - r0), split, partial, scratch);
  }
}
