// The int8 kernels that are the same on every vector width, written once over the traits struct `V` (simd.h):
// per-token activation quantization and the two "dot" kernels (decode, small M) of Note [Two loop shapes]
// in linear_int8.cpp, weight-only (fp32 FMAs on widened codes) and dynamic-activation (V's u8 x s8 dot step).
//
// NO include guard on purpose: linear_int8.cpp includes this file once inside each ISA's `#pragma GCC
// target` region, in that ISA's namespace, after `using V = Vec512;` (or Vec256), so every function here is
// compiled for that ISA (a function template takes the target of the region it is defined in, not of its
// caller). A next ISA is one more traits struct and one more region, not a copy of this code.

using F = V::F;
using I = V::I;

// ================================================================ activation quantization
// Note [non-finite activation rows]: a vector max drops NaN and an Inf saturates to a finite code, so a row
// holding NaN / Inf would come out finite and wrong. Such a row gets a NaN scale instead, which makes exactly
// its output row NaN, as F.linear on the float row gives (the oracle's reference does the same).
void quantize_rows(const float* x, int64_t ldx, int64_t K, bool symmetric, uint8_t* a, int64_t lda,
                   float* scale, int32_t* zp128, int64_t m0, int64_t m1, int bits) {
  constexpr int L = V::L;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    uint8_t* ar = a + m * lda;
    F lo = V::zero(), hi = V::zero(), poison = V::zero();
    int64_t k = 0;
    for (; k < K; k += L) {
      const F v = k + L <= K ? V::loadu(xr + k) : V::loadu_n(xr + k, K - k);  // lanes past K read as 0
      poison = V::add(poison, V::mul(v, V::zero()));  // NaN iff some x is NaN / Inf
      if (symmetric) {
        hi = V::max(hi, V::abs(v));
      } else {
        lo = V::min(lo, v);
        hi = V::max(hi, v);
      }
    }
    float s;
    int zp = 0;
    if (symmetric) {
      s = symmetric_act_scale(V::reduce_max(hi), bits);
    } else {
      s = asymmetric_act_scale(V::reduce_min(lo), V::reduce_max(hi), &zp, bits);
    }
    if (!std::isfinite(V::reduce(poison))) {
      s = kNaN;  // Note [non-finite activation rows]
      zp = 0;
    }
    const F sv = V::set1(s), zv = V::set1((float)zp), qlo = V::set1(act_qmin(bits)), qhi = V::set1(act_qmax(bits));
    const I shift = V::set1_i(128);
    for (k = 0; k < K; k += L) {
      const bool full = k + L <= K;
      F v = V::add(V::div(full ? V::loadu(xr + k) : V::loadu_n(xr + k, K - k), sv), zv);
      v = V::min(V::max(V::round_even(v), qlo), qhi);  // round half to even, as the oracle
      const I q = V::add_i(V::cvt_i(v), shift);
      if (full) {
        V::store_u8(ar + k, q);
      } else {
        uint8_t t[L];
        V::store_u8(t, q);
        std::memcpy(ar + k, t, K - k);
      }
    }
    std::memset(ar + K, 0, lda - K);
    scale[m] = s;
    zp128[m] = 128 + zp;
  }
}

// ================================================================ weight-only, dot kernel
constexpr int NB = 4;  // weight rows per tile
// Tokens per tile: MB x NB accumulators, NB weight vectors and NB group scales stay in registers.
constexpr int kWoMaxMB = V::kRegs / 8;
// Note [decode rows in flight]: one token reads 8 weight rows at once, not 4. Each row is its own stream for
// the hardware prefetcher, and with 4 streams one core kept too few lines in flight to reach the bus: 4096^2
// int8 at M = 1 from memory (a standalone loop, Zen 4) read 13.7 GB/s on one core and 30 on two with 4 rows,
// 17.5 and 37 with 8 (16 rows: 9 and 19, the accumulators spill). On 16 ymm registers 8 rows spill (in-cache
// 28 -> 22 GB/s, from memory no faster), and several tokens keep 4 rows: their MB x NB accumulators must stay in
// registers.
constexpr int kDecodeNB = V::L == 16 ? 8 : NB;
// Note [decode prefetch] (int4_tiled_dot.inc): each row's bytes prefetched into L2 once per cache line (64 k), which
// took M = 1 from about 50% to about 70% of a plain streaming sum's bandwidth at 4 KiB ahead. How far ahead: one tile
// of NB rows, as the low-bit dot loop does (Note [decode prefetch distance], linear_lowbit_isa.h); 4 KiB landed
// inside the tile's own rows at K = 4096 here too. On the Intel Xeon (AMX VM, 2 threads, M = 1 from DRAM,
// bench_linear.py --formats int8, f32 x, two rounds) 4096 x 4096 took 0.70-0.71 ms 4 KiB ahead, 0.65-0.66 at 16 KiB
// and 0.64-0.66 at 32 KiB (one 8-row tile); forced AVX2 (4-row tiles) 0.80-0.82 at 4 KiB, 0.67-0.68 at 16 KiB (one
// tile), 0.70-0.71 at 32 KiB. Unlike the low-bit rows, an int8 row is a byte per weight: the distance is capped at
// kPfMaxBytes (a 4096 x 11008 tile would be 88 KiB ahead; capped, that call went 1.90 -> 1.70 ms).
constexpr int64_t kPfMaxBytes = 32768;
inline int64_t tile_prefetch_bytes(int nb, int64_t ldw) { return std::min<int64_t>(nb * ldw, kPfMaxBytes); }

// L k (the first n of them if kTail) of NB weight rows x MB tokens. A function, not a lambda: Note
// [accumulators in registers] in kernels.h.
template <int MB, int NB, bool GROUPED, bool kTail>
__attribute__((always_inline)) inline void wo_step(F (&acc)[MB][NB], const int8_t* const (&wr)[NB],
                                                   const float* const (&xr)[MB], const F (&sv)[NB], int64_t k,
                                                   int64_t n) {
  F wv[NB];
  for (int i = 0; i < NB; ++i) {
    wv[i] = kTail ? V::s8_to_f_n(wr[i] + k, n) : V::s8_to_f(wr[i] + k);
    if (GROUPED) wv[i] = V::mul(wv[i], sv[i]);
  }
  for (int m = 0; m < MB; ++m) {
    const F xv = kTail ? V::loadu_n(xr[m] + k, n) : V::loadu(xr[m] + k);
    for (int i = 0; i < NB; ++i) acc[m][i] = V::fmadd(xv, wv[i], acc[m][i]);
  }
}

// Rows n0..n0+nr-1 (nr <= NB) x tokens m0..m0+MB-1. Rows past nr repeat the last row (results dropped).
template <int MB, int NB, bool GROUPED>
void wo_dot_tile(const WeightOnlyArgs& p, int64_t m0, int64_t n0, int nr) {
  const int8_t* wr[NB];
  const float* sr[NB];
  for (int i = 0; i < NB; ++i) {
    const int64_t n = n0 + std::min(i, nr - 1);
    wr[i] = p.w + n * p.ldw;
    sr[i] = p.scale + n * p.G;
  }
  const float* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = p.x + (m0 + m) * p.ldx;
  F acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NB; ++i) acc[m][i] = V::zero();
  // One segment per group with its scale folded into the weights (GROUPED), or one segment [0, K) with the
  // scale applied at the end. Whole cache lines first (one prefetch per row each), then single vectors, then
  // one partial vector.
  const int64_t nseg = GROUPED ? p.G : 1, seg = GROUPED ? p.g : p.K, pf = tile_prefetch_bytes(NB, p.ldw);
  for (int64_t gi = 0; gi < nseg; ++gi) {
    F sv[NB];
    for (int i = 0; i < NB; ++i) sv[i] = GROUPED ? V::set1(sr[i][gi]) : V::zero();
    const int64_t ke = (gi + 1) * seg;
    int64_t k = gi * seg;
    for (; k + 64 <= ke; k += 64) {
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + k + pf), _MM_HINT_T1);
#pragma GCC unroll 8
      for (int u = 0; u < 64 / V::L; ++u) wo_step<MB, NB, GROUPED, false>(acc, wr, xr, sv, k + V::L * u, 0);
    }
    for (; k + V::L <= ke; k += V::L) wo_step<MB, NB, GROUPED, false>(acc, wr, xr, sv, k, 0);
    if (k < ke) wo_step<MB, NB, GROUPED, true>(acc, wr, xr, sv, k, ke - k);
  }
  float red[MB][NB];  // every acc index a compile-time constant: Note [accumulators in registers]
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) red[m][i] = V::reduce(acc[m][i]);
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < nr; ++i) {
      float v = red[m][i];
      if (!GROUPED) v *= sr[i][0];
      p.out[(m0 + m) * p.ldo + n0 + i] = v + (p.bias ? p.bias[n0 + i] : 0.f);
    }
}

// The last mb (< MB) tokens: the tile of exactly mb tokens.
template <int MB, bool GROUPED>
void wo_dot_rest(const WeightOnlyArgs& p, int64_t m0, int64_t n0, int nr, int64_t mb) {
  if constexpr (MB > 1) {
    if (mb < MB) return wo_dot_rest<MB - 1, GROUPED>(p, m0, n0, nr, mb);
  }
  wo_dot_tile<MB, NB, GROUPED>(p, m0, n0, nr);
}

template <bool GROUPED>
void wo_dot(const WeightOnlyArgs& p, int64_t n0, int64_t n1) {
  if (p.M == 1) {  // Note [decode rows in flight]
    for (int64_t n = n0; n < n1; n += kDecodeNB)
      wo_dot_tile<1, kDecodeNB, GROUPED>(p, 0, n, (int)std::min<int64_t>(kDecodeNB, n1 - n));
    return;
  }
  for (int64_t n = n0; n < n1; n += NB) {
    const int nr = (int)std::min<int64_t>(NB, n1 - n);
    int64_t m = 0;
    for (; m + kWoMaxMB <= p.M; m += kWoMaxMB) wo_dot_tile<kWoMaxMB, NB, GROUPED>(p, m, n, nr);
    if (m < p.M) wo_dot_rest<kWoMaxMB - 1, GROUPED>(p, m, n, nr, p.M - m);
  }
}

// ================================================================ dynamic activation, dot kernel
// V::kDotBytes k of NB weight rows x MB tokens (the first n of them if kTail; the activation rows are
// zero-padded to lda, so only the weight needs a partial load).
template <int MB, int NB, bool kTail>
__attribute__((always_inline)) inline void da_step(I (&acc)[MB][NB], I (&rs)[NB], const int8_t* const (&wr)[NB],
                                                   const uint8_t* const (&ar)[MB], int64_t k, int64_t n) {
  typename V::B wv[NB];
  for (int i = 0; i < NB; ++i) {
    wv[i] = kTail ? V::load_b_n(wr[i] + k, n) : V::load_b(wr[i] + k);
    rs[i] = V::sum_b(rs[i], wv[i]);
  }
  for (int m = 0; m < MB; ++m) {
    const typename V::A av = V::load_a(ar[m] + k);
    for (int i = 0; i < NB; ++i) acc[m][i] = V::dot(acc[m][i], av, wv[i]);
  }
}

template <int MB, int NB>
void da_dot_tile(const DynamicActArgs& p, int64_t m0, int64_t n0, int nr) {
  const int8_t* wr[NB];
  for (int i = 0; i < NB; ++i) wr[i] = p.w + (n0 + std::min(i, nr - 1)) * p.ldw;
  const uint8_t* ar[MB];
  for (int m = 0; m < MB; ++m) ar[m] = p.a + (m0 + m) * p.lda;
  I acc[MB][NB], rs[NB];
  for (int i = 0; i < NB; ++i) {
    rs[i] = V::zero_i();
    for (int m = 0; m < MB; ++m) acc[m][i] = V::zero_i();
  }
  const int64_t pf = tile_prefetch_bytes(NB, p.ldw);
  int64_t k = 0;
  // Each row's bytes one tile ahead into L2, once per cache line, as the weight-only kernel does (Note [decode
  // prefetch] above). This loop had no software prefetch; 4 KiB ahead took the Intel Xeon (AMX VM, 2 threads, M = 1
  // from DRAM, bench_linear.py --formats int8) from 1.78-1.82 to 1.65-1.72 ms at 4096 x 11008 (forced AVX2: 1.98-2.05
  // -> 1.93), one tile ahead to 1.61-1.65 (AVX2 1.75-1.82).
  for (; k + V::kDotBytes <= p.K; k += V::kDotBytes) {
    if ((k & 63) == 0)
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + k + pf), _MM_HINT_T1);
    da_step<MB, NB, false>(acc, rs, wr, ar, k, 0);
  }
  if (k < p.K) da_step<MB, NB, true>(acc, rs, wr, ar, k, p.K - k);
  int32_t red[MB][NB], red_rs[NB];  // every index a compile-time constant: Note [accumulators in registers]
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i) {
    red_rs[i] = V::reduce_i(rs[i]);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) red[m][i] = V::reduce_i(acc[m][i]);
  }
  for (int i = 0; i < nr; ++i) {
    const int64_t n = n0 + i;
    for (int m = 0; m < MB; ++m) {
      const int32_t dot = red[m][i] - p.a_zp128[m0 + m] * red_rs[i];
      p.out[(m0 + m) * p.ldo + n] = (float)dot * (p.a_scale[m0 + m] * p.w_scale[n]) + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

void da_dot(const DynamicActArgs& p, int64_t n0, int64_t n1) {
  if (p.M == 1) {  // Note [decode rows in flight]
    for (int64_t n = n0; n < n1; n += kDecodeNB)
      da_dot_tile<1, kDecodeNB>(p, 0, n, (int)std::min<int64_t>(kDecodeNB, n1 - n));
    return;
  }
  for (int64_t n = n0; n < n1; n += NB) {
    const int nr = (int)std::min<int64_t>(NB, n1 - n);
    int64_t m = 0;
    for (; m + 2 <= p.M; m += 2) da_dot_tile<2, NB>(p, m, n, nr);
    if (m < p.M) da_dot_tile<1, NB>(p, m, n, nr);
  }
}
