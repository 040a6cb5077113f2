// The attention kernel of torchqkit::sdpa_over_filled_cache written once over a vector-width traits struct V
// (simd.h). Included by decode_attention.cpp inside each ISA's `#pragma GCC target` region, after `using V = ...`.
// See Note [Filled-cache attention kernel] in decode_attention.cpp.

using F = V::F;
using I = V::I;
constexpr int L = V::L;
// Output columns per pass over V's rows: RB x kCols accumulators stay in registers (4 x 4 of 32 zmm, 4 x 2 of
// 16 ymm), next to the kCols value vectors of the step.
constexpr int kCols = V::kRegs >= 32 ? 4 : 2;

// e^x for the softmax weights (x = score - row max <= 0): Cephes' expf (range reduction by ln 2 in two parts,
// degree-6 polynomial, about 1 ulp), exactly 0 below -87.3 (e^x leaves the normal floats) and for -inf.
inline F exp_nonpositive(F x) {
  const F xc = V::max(x, V::set1(-87.3f));
  const F fx = V::round_even(V::mul(xc, V::set1(1.44269504088896341f)));
  F r = V::fmadd(fx, V::set1(-0.693359375f), xc);
  r = V::fmadd(fx, V::set1(2.12194440e-4f), r);
  F y = V::set1(1.9875691500e-4f);
  y = V::fmadd(y, r, V::set1(1.3981999507e-3f));
  y = V::fmadd(y, r, V::set1(8.3334519073e-3f));
  y = V::fmadd(y, r, V::set1(4.1665795894e-2f));
  y = V::fmadd(y, r, V::set1(1.6666665459e-1f));
  y = V::fmadd(y, r, V::set1(5.0000001201e-1f));
  y = V::fmadd(y, V::mul(r, r), V::add(r, V::set1(1.f)));
  return V::zero_below(x, -87.3f, V::scale_pow2(y, V::cvt_i(fx)));
}

// One tile of RB query rows that share a K/V head (rows of several query heads and query positions): pass 1
// writes the masked, scaled scores s[r][0:n] (each key row loaded once for the RB dot products) and each row's
// maximum; pass 2 turns them into e^(s - max) and sums; pass 3 accumulates sum_j e_j v_j kCols vectors of
// output columns at a time (each value row loaded once per column block for the RB rows) and divides.
// A row that sees no position (max -inf) gets zeros, as sdpa returns for it.
template <int RB>
void attend_tile(const FilledAttentionArgs& p, const float* const* q, const int64_t* moff, float* const* out,
                 const float* k, const float* v, float* s) {
  const int64_t n = p.n, D = p.D, Dv = p.Dv;
  float mx[RB], inv[RB];
  for (int r = 0; r < RB; ++r) mx[r] = -std::numeric_limits<float>::infinity();

  // ---- pass 1: scores
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + j * p.k_ss;
    F acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = V::zero();
    int64_t d = 0;
    for (; d + L <= D; d += L) {
      const F kv = V::loadu(kj + d);
      for (int r = 0; r < RB; ++r) acc[r] = V::fmadd(V::loadu(q[r] + d), kv, acc[r]);
    }
    if (d < D) {
      const F kv = V::loadu_n(kj + d, D - d);
      for (int r = 0; r < RB; ++r) acc[r] = V::fmadd(V::loadu_n(q[r] + d, D - d), kv, acc[r]);
    }
    for (int r = 0; r < RB; ++r) {
      float x = V::reduce(acc[r]) * p.scale;
      if (p.mask_bool) {
        if (!p.mask_bool[moff[r] + j]) x = -std::numeric_limits<float>::infinity();
      } else {
        x += p.mask_add[moff[r] + j];
      }
      s[r * n + j] = x;
      mx[r] = x > mx[r] ? x : mx[r];
    }
  }

  // ---- pass 2: weights e^(s - max) and their sum
  for (int r = 0; r < RB; ++r) {
    float* sr = s + r * n;
    if (mx[r] == -std::numeric_limits<float>::infinity()) {  // sees nothing: weights 0, output 0
      for (int64_t j = 0; j < n; ++j) sr[j] = 0.f;
      inv[r] = 0.f;
      continue;
    }
    const F m = V::set1(mx[r]);
    F sum = V::zero();
    int64_t j = 0;
    for (; j + L <= n; j += L) {
      const F e = exp_nonpositive(V::sub(V::loadu(sr + j), m));
      V::storeu(sr + j, e);
      sum = V::add(sum, e);
    }
    float total = V::reduce(sum);
    for (; j < n; ++j) {
      sr[j] = std::exp(sr[j] - mx[r]);
      total += sr[j];
    }
    inv[r] = 1.f / total;
  }

  // ---- pass 3: out = sum_j e_j v_j / sum_j e_j, kCols vectors of columns at a time
  for (int64_t d0 = 0; d0 < Dv; d0 += kCols * L) {
    const int64_t w = std::min<int64_t>(kCols * L, Dv - d0);
    F acc[RB][kCols];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < kCols; ++c) acc[r][c] = V::zero();
    if (w == kCols * L) {
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = v + j * p.v_ss + d0;
        F vv[kCols];
        for (int c = 0; c < kCols; ++c) vv[c] = V::loadu(vj + c * L);
        for (int r = 0; r < RB; ++r) {
          const F e = V::set1(s[r * n + j]);
          for (int c = 0; c < kCols; ++c) acc[r][c] = V::fmadd(e, vv[c], acc[r][c]);
        }
      }
    } else {  // the last, narrower block: whole vectors, then one partial vector
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = v + j * p.v_ss + d0;
        for (int c = 0; c < kCols; ++c) {
          const int64_t off = c * L;
          if (off >= w) break;
          const F vv = off + L <= w ? V::loadu(vj + off) : V::loadu_n(vj + off, w - off);
          for (int r = 0; r < RB; ++r) acc[r][c] = V::fmadd(V::set1(s[r * n + j]), vv, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const F scale = V::set1(inv[r]);
      for (int c = 0; c < kCols; ++c) {
        const int64_t off = c * L;
        if (off >= w) break;
        const F o = V::mul(acc[r][c], scale);
        if (off + L <= w) {
          V::storeu(out[r] + d0 + off, o);
        } else {
          alignas(64) float tmp[L];
          V::storeu(tmp, o);
          std::memcpy(out[r] + d0 + off, tmp, sizeof(float) * (w - off));
        }
      }
    }
  }
}

// Items [item0, item1) of (b, kv head): the group's G * Lq query rows in tiles of up to 4.
inline void attend_items(const FilledAttentionArgs& p, int64_t item0, int64_t item1, float* scratch) {
  const int64_t G = p.Hq / p.Hkv, R = G * p.Lq;
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t b = item / p.Hkv, kvh = item % p.Hkv;
    const float* k = p.k + b * p.k_sb + kvh * p.k_sh;
    const float* v = p.v + b * p.v_sb + kvh * p.v_sh;
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int rb = (int)std::min<int64_t>(4, R - r0);
      const float* q[4];
      int64_t moff[4];
      float* out[4];
      for (int r = 0; r < rb; ++r) {
        const int64_t h = kvh * G + (r0 + r) / p.Lq, l = (r0 + r) % p.Lq;
        q[r] = p.q + b * p.q_sb + h * p.q_sh + l * p.q_sl;
        moff[r] = b * p.m_sb + h * p.m_sh + l * p.m_sl;
        out[r] = p.out + b * p.o_sb + h * p.o_sh + l * p.o_sl;
      }
      switch (rb) {
        case 4: attend_tile<4>(p, q, moff, out, k, v, scratch); break;
        case 3: attend_tile<3>(p, q, moff, out, k, v, scratch); break;
        case 2: attend_tile<2>(p, q, moff, out, k, v, scratch); break;
        default: attend_tile<1>(p, q, moff, out, k, v, scratch); break;
      }
    }
  }
}
