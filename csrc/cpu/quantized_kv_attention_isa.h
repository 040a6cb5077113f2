// The kernel of torchqkit::sdpa_quantized_kv_cache written once in plain loops that the compiler vectorizes at the
// width of the ISA region it is included in (quantized_kv_attention.cpp: scalar, AVX2 + FMA, AVX-512).
// See Note [Quantized KV attention kernel] in quantized_kv_attention.cpp.

// Row j of one side as floats in `buf` (D values): the tail row itself, or its codes dequantized into `buf`.
inline const float* side_row(const QuantizedSide& s, int64_t b, int64_t h, int64_t j, int64_t D, float* buf) {
  if (j >= s.nq) return s.tail + b * s.t_sb + h * s.t_sh + (j - s.nq) * s.t_ss;
  const uint8_t* c = s.codes + b * s.c_sb + h * s.c_sh + j * s.c_ss;
  const int64_t srow = s.per_channel ? j / s.group : j;
  const uint16_t* sc = s.scale + b * s.s_sb + h * s.s_sh + srow * s.s_ss;
  const uint16_t* zp = s.zero ? s.zero + b * s.s_sb + h * s.s_sh + srow * s.s_ss : nullptr;
  // ---- codes to floats (int4: unpack the two nibbles of each byte first)
  float* f = buf;
  switch (s.format) {
    case KvFormat::kInt8:
      for (int64_t d = 0; d < D; ++d) f[d] = (float)c[d] - 128.f;
      break;
    case KvFormat::kInt4:
      for (int64_t i = 0; i < D / 2; ++i) {
        f[2 * i] = (float)(c[i] & 15) - 8.f;
        f[2 * i + 1] = (float)(c[i] >> 4) - 8.f;
      }
      if (D & 1) f[D - 1] = (float)(c[D / 2] & 15) - 8.f;
      break;
    case KvFormat::kFloat8E4M3:
      for (int64_t d = 0; d < D; ++d) f[d] = kFloat8E4M3Table[c[d]];
      break;
    case KvFormat::kFloat8E5M2:
      for (int64_t d = 0; d < D; ++d) f[d] = kFloat8E5M2Table[c[d]];
      break;
  }
  // ---- scale (and zero): per channel one per element, per token one per group of `group` elements
  if (s.per_channel) {
    if (zp) {
      for (int64_t d = 0; d < D; ++d) f[d] = f[d] * half_to_float(sc[d]) + half_to_float(zp[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) f[d] *= half_to_float(sc[d]);
    }
  } else {
    for (int64_t g0 = 0, gi = 0; g0 < D; g0 += s.group, ++gi) {
      const int64_t g1 = std::min(D, g0 + s.group);
      const float a = half_to_float(sc[gi]), z = zp ? half_to_float(zp[gi]) : 0.f;
      for (int64_t d = g0; d < g1; ++d) f[d] = f[d] * a + z;
    }
  }
  return f;
}

// Items [item0, item1) of (b, kv head): every query row of the group (R = G * Lq) against each K row once, then
// each V row once. Scratch: R * n scores, R * Dv accumulators, two dequantized rows.
inline void attend_items(const QuantizedAttentionArgs& p, int64_t item0, int64_t item1, float* scratch) {
  const int64_t G = p.Hq / p.Hkv, R = G * p.Lq, n = p.n, D = p.D, Dv = p.Dv;
  float* s = scratch;
  float* acc = s + R * n;
  float* kbuf = acc + R * Dv;
  float* vbuf = kbuf + D;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t b = item / p.Hkv, kvh = item % p.Hkv;
    // ---- pass 1: scores, masked
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = side_row(p.k, b, kvh, j, D, kbuf);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = kvh * G + r / p.Lq, l = r % p.Lq;
        const float* q = p.q + b * p.q_sb + h * p.q_sh + l * p.q_sl;
        float x = 0.f;
        for (int64_t d = 0; d < D; ++d) x += q[d] * kj[d];
        x *= p.scale;
        const int64_t moff = b * p.m_sb + h * p.m_sh + l * p.m_sl + j;
        if (p.mask_bool) x = p.mask_bool[moff] ? x : kNegInf;
        else if (p.mask_add) x += p.mask_add[moff];
        else if (j > n - p.Lq + l) x = kNegInf;  // causal: query l sits at position n - Lq + l
        s[r * n + j] = x;
      }
    }
    // ---- pass 2: weights e^(s - max), each row divided by its sum at the end
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * n;
      float mx = kNegInf;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sr[j]);
      float* ar = acc + r * Dv;
      for (int64_t d = 0; d < Dv; ++d) ar[d] = 0.f;
      if (mx == kNegInf) {  // sees nothing: weights 0, output 0 (as sdpa)
        for (int64_t j = 0; j < n; ++j) sr[j] = 0.f;
        continue;
      }
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        sr[j] = std::exp(sr[j] - mx);
        total += sr[j];
      }
      const float inv = 1.f / total;
      for (int64_t j = 0; j < n; ++j) sr[j] *= inv;
    }
    // ---- pass 3: out = sum_j w_j v_j, each V row dequantized once for all R rows
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = side_row(p.v, b, kvh, j, Dv, vbuf);
      for (int64_t r = 0; r < R; ++r) {
        const float w = s[r * n + j];
        float* ar = acc + r * Dv;
        for (int64_t d = 0; d < Dv; ++d) ar[d] += w * vj[d];
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t h = kvh * G + r / p.Lq, l = r % p.Lq;
      float* o = p.out + b * p.o_sb + h * p.o_sh + l * p.o_sl;
      std::memcpy(o, acc + r * Dv, sizeof(float) * Dv);
    }
  }
}
