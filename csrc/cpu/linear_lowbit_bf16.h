// The low-bit weight-only kernels for bf16 activations on AVX512-BF16: levels decoded to bf16 (exact for every
// format but nf4, see Note [nf4 levels in bf16]) and multiplied by vdpbf16ps, fp32 accumulation.
//   * decode (small M): one vdpbf16ps per 32 weights and token instead of two fp32 FMAs;
//   * prefill: 32-row bf16 k-pair panels + the register-blocked micro-kernel of bf16_gemm.h.
//
// NO include guard on purpose: linear_lowbit.cpp includes this file once, inside its AVX512-BF16
// `#pragma GCC target` region, after linear_lowbit_isa.h (whose decoders, step helpers and scale_row it uses)
// with `using V = Vec512;`.
//
// Activations: LowbitArgs::xb, bf16 (M, ldx) with zero columns from K to ldx (a multiple of 32). Offsets (intx zero
// points): the prefill adds sum_g xsum[m, g] * offset[n, g] per panel (LowbitArgs::xsum); the dot kernels don't
// apply them (the glue adds that term after, and passes offset = nullptr).
//
// Note [nf4 levels in bf16]: int codes, fp8 e4m3 / e5m2 and fp4 e2m1 values have at most 3 mantissa bits: exact
// in bf16 (7). The NF4 levels are not: rounded to bf16 each moves by at most 2^-9 relative (0.72295684 ->
// 0.72265625). The errors are fixed per level and enter a row's sum with the activations' signs, so they mostly
// cancel: measured 5e-4 of max |y| at K = 4096 (nf4 b64, random activations), an eighth of the bf16 output's own
// ulp (2^-8 relative), inside the budget every bf16 route has (2 output ulps; test_linear_lowbit.py checks nf4 at
// K = 4096 and M up to 257). So nf4 takes the bf16 kernels too, not fp32.

static_assert(W == 2, "the bf16 kernels take a decode step (32 weights) as one zmm of bf16");

// A format's decoder with its 32 levels per step rounded to bf16: k order (panels) or the decoder's dot order
// (x permuted to match, Note [Low-bit decode steps]).
template <class D>
struct Bf16Levels {
  D d;
  explicit Bf16Levels(const LowbitArgs& p) : d(p) {}
  __m512i k_order(const uint8_t* b) const {
    F w[W];
    d(b, w);
    return bf16_gemm::to_bf16(w[0], w[1]);
  }
  __m512bh dot_order(const uint8_t* b) const {
    F w[W];
    d.dot_order(b, w);
    return (__m512bh)bf16_gemm::to_bf16(w[0], w[1]);
  }
};

// 4-bit codes: one vpermw over 32 bf16 entries (the 16 levels twice, so an index's bit 4 is ignored and the
// zero-extended bytes need no mask) turns 32 nibbles into 32 bf16 levels.
template <bool kHighFirst>
struct Bf16Lut4 {
  __m512i table;
  explicit Bf16Lut4(const float* levels) : table(bf16_gemm::to_bf16(V::loadu(levels), V::loadu(levels))) {}
  __m512i k_order(const uint8_t* b) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    const __m128i first = kHighFirst ? _mm_unpacklo_epi8(hi, lo) : _mm_unpacklo_epi8(lo, hi);
    const __m128i second = kHighFirst ? _mm_unpackhi_epi8(hi, lo) : _mm_unpackhi_epi8(lo, hi);
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_set_m128i(second, first)), table);
  }
  // Lanes 0..15: the low nibbles of bytes 0..15, lanes 16..31 their high nibbles: Lut4's dot order.
  __m512bh dot_order(const uint8_t* b) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_srli_epi16(v, 4), v)), table);
  }
};
template <> struct Bf16Levels<Nf4> : Bf16Lut4<true> { explicit Bf16Levels(const LowbitArgs&) : Bf16Lut4(kNf4) {} };
template <> struct Bf16Levels<Fp4> : Bf16Lut4<false> { explicit Bf16Levels(const LowbitArgs&) : Bf16Lut4(kFp4) {} };

// ================================================================ prefill: bf16 panels + vdpbf16ps tiles

inline int64_t bf16_segment(const LowbitArgs& p) { return bf16_gemm::segment_k(p.G, p.g); }

// Rows [b0, b0 + nb) x k [k0, k0 + kc) -> panel (bf16 levels, Note [bf16 panels]) and their segment scales
// sc[s][j] (scale_mul included); columns past nb zero. 16 rows x one decode step at a time, transposed in registers.
template <class D>
void fill_panel(const LowbitArgs& p, const Bf16Levels<D>& dec, int64_t b0, int nb, int64_t k0, int64_t kc,
                int64_t seg, uint32_t* panel, float* sc) {
  const int64_t rb = D::row_bytes(p), nst = (p.K + kStep - 1) / kStep, nfull = full_steps<D>(rb, nst);
  const int64_t nseg = (kc + seg - 1) / seg;
  alignas(64) uint8_t tmp[32];
  for (int j0 = 0; j0 < bf16_gemm::kPanelCols; j0 += 16) {
    const uint8_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = j0 + i < nb ? p.w + (b0 + j0 + i) * p.ldw : nullptr;
    for (int64_t c = k0 / kStep; c < (k0 + kc) / kStep; ++c) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = !rows[i] ? _mm512_setzero_si512()
                        : dec.k_order(c < nfull ? rows[i] + c * D::kBytes : step_ptr<D>(rows[i], c, rb, tmp));
      bf16_gemm::store_pairs16(r, panel, (c * kStep - k0) / 2, j0);
    }
  }
  for (int j = 0; j < bf16_gemm::kPanelCols; ++j) {
    const int64_t base = j < nb ? scale_base(p, b0 + j) : 0;
    for (int64_t s = 0; s < nseg; ++s)
      sc[s * bf16_gemm::kPanelCols + j] = j < nb ? scale_at(p, base, p.G == 1 ? 0 : (k0 + s * seg) / p.g) : 0.f;
  }
}

// Rows [n0, n1) through bf16_gemm's panel loop (Note [bf16 panel loop]). Offsets (intx zero points) come in as
// the panel loop's group terms when the glue passed the per-group sums of x (p.xsum).
template <class D>
void prefill_bf16(const LowbitArgs& p, int64_t n0, int64_t n1) {
  const Bf16Levels<D> dec(p);
  const int64_t seg = bf16_segment(p), K32 = (p.K + kStep - 1) / kStep * kStep;
  const bf16_gemm::PanelProblem pb{p.xb,  p.M,   p.ldx,  K32, bf16_gemm::panel_block_k(seg), seg, p.out, p.ldo,
                                   p.bias, p.offset ? p.xsum : nullptr, p.G, p.xb_planes};
  bf16_gemm::panel_gemm(
      pb, n0, n1,
      [&](int64_t b0, int nb, int64_t k0, int64_t kc, uint32_t* panel, float* sc) {
        fill_panel<D>(p, dec, b0, nb, k0, kc, seg, panel, sc);
      },
      [&](int64_t b0, int nb, float* zp) {
        for (int j = 0; j < bf16_gemm::kPanelCols; ++j) {
          const int64_t base = j < nb ? scale_base(p, b0 + j) : 0;
          for (int64_t gi = 0; gi < p.G; ++gi) zp[gi * bf16_gemm::kPanelCols + j] = j < nb ? offset_at(p, base, gi) : 0.f;
        }
      });
}

// ================================================================ decode: vdpbf16ps dot tiles

// One step of NB rows x MB tokens: a function, not a lambda (Note [accumulators in registers] in kernels.h).
template <class D, int MB, int NB>
__attribute__((always_inline)) inline void bf16_step(F (&acc)[MB][NB], const Bf16Levels<D>& dec,
                                                     const uint8_t* const (&src)[NB],
                                                     const uint16_t* const (&xr)[MB], int64_t c) {
  __m512bh xv[MB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(xr[m] + kStep * c);
#pragma GCC unroll 4
  for (int i = 0; i < NB; ++i) {
    const __m512bh w = dec.dot_order(src[i]);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], xv[m], w);
  }
}

// Steps [c0, c1) of a group (or row) into acc (walk_steps in linear_lowbit_isa.h).
template <class D, int MB, int NB>
__attribute__((always_inline)) inline void bf16_steps(F (&acc)[MB][NB], const Bf16Levels<D>& dec,
                                                      const uint8_t* const (&wr)[NB], const uint16_t* const (&xr)[MB],
                                                      uint8_t (&tmp)[NB][32], int64_t c0, int64_t c1, int64_t nfull,
                                                      int64_t rb) {
  walk_steps<D, NB>(wr, tmp, c0, c1, nfull, rb,
                    [&](const uint8_t* const (&src)[NB], int64_t c) __attribute__((always_inline)) {
                      bf16_step<D, MB, NB>(acc, dec, src, xr, c);
                    });
}

// NB rows from n0 (nr real, a short tile repeats its last row) x MB tokens from m0. kGroups: a group's sums
// times its scale once per group (Note [Group scales once per group]); else one scale per row, after the row.
template <class D, int MB, int NB, bool kGroups>
void bf16_tile(const LowbitArgs& p, const Bf16Levels<D>& dec, const uint16_t* x, const float* const* srow,
               int64_t m0, int64_t n0, int nr) {
  const int64_t nst = (p.K + kStep - 1) / kStep, rb = D::row_bytes(p), nfull = full_steps<D>(rb, nst);
  const int64_t spg = kGroups ? p.g / kStep : nst;
  const uint8_t* wr[NB];
  for (int i = 0; i < NB; ++i) wr[i] = p.w + (n0 + std::min(i, nr - 1)) * p.ldw;
  const uint16_t* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = x + (m0 + m) * p.ldx;
  F acc[MB][NB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < NB; ++i) acc[m][i] = V::zero();
  alignas(64) uint8_t tmp[NB][32];
  for (int64_t c0 = 0, gi = 0; c0 < nst; c0 += spg, ++gi) {
    const int64_t c1 = std::min(nst, c0 + spg);
    if constexpr (kGroups) {
      F g[MB][NB];
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
        for (int i = 0; i < NB; ++i) g[m][i] = V::zero();
      bf16_steps<D, MB, NB>(g, dec, wr, xr, tmp, c0, c1, nfull, rb);
#pragma GCC unroll 4
      for (int i = 0; i < NB; ++i) {
        const F s = V::set1(srow[std::min(i, nr - 1)][gi]);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) acc[m][i] = V::fmadd(g[m][i], s, acc[m][i]);
      }
    } else {
      bf16_steps<D, MB, NB>(acc, dec, wr, xr, tmp, c0, c1, nfull, rb);
    }
  }
  float red[MB][NB];  // every acc index a compile-time constant: Note [accumulators in registers]
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) red[m][i] = V::reduce(acc[m][i]);
  for (int i = 0; i < nr; ++i) {
    const float s = (kGroups ? 1.f : srow[i][0]) * p.scale_mul;
    for (int m = 0; m < MB; ++m) store(p, m0 + m, n0 + i, red[m][i] * s);
  }
}

// Rows [n0, n0 + nr) (nr <= kRows) x tokens [m0, m0 + MB), in tiles of NB rows. With group sums, one row per
// tile: with two or more GCC 12 kept some of the accumulators on the stack, stored and reloaded on every step
// (perf: nf4 g64 ran 3x slower than the fp32 kernel at M = 8 with 4 x 2 tiles, 1.5x at M = 1 with 1 x 4).
template <class D, int MB, int NB, bool kGroups>
void bf16_row_tiles(const LowbitArgs& p, const Bf16Levels<D>& dec, const uint16_t* x, const float* const* srow,
                    int64_t m0, int64_t n0, int nr) {
  for (int r = 0; r < nr; r += NB)
    bf16_tile<D, MB, NB, kGroups>(p, dec, x, srow + r, m0, n0 + r, std::min(NB, nr - r));
}

template <class D, int MB>
void bf16_tiles(const LowbitArgs& p, const Bf16Levels<D>& dec, const uint16_t* x, const float* const* srow,
                int64_t m0, int64_t n0, int nr) {
  if (p.G == 1) bf16_row_tiles<D, MB, MB <= 2 ? 4 : 2, false>(p, dec, x, srow, m0, n0, nr);
  else bf16_row_tiles<D, MB, 1, true>(p, dec, x, srow, m0, n0, nr);
}

// Rows [n0, n1) x all tokens; groups are whole steps (or one per row): the glue checks. p.xb is in the
// decoder's dot order (nf4 / fp4: Note [Low-bit decode steps]); the glue permutes it once per call.
template <class D>
void dot_bf16(const LowbitArgs& p, int64_t n0, int64_t n1) {
  const Bf16Levels<D> dec(p);
  const uint16_t* x = p.xb;
  // Not for_each_tile (linear_lowbit_isa.h): through its lambda GCC lays this loop out differently and the bf16
  // int3 decode measured 8% slower (M = 1, 1 thread, alternated runs); the fp32 kernels walk through it.
  AlignedVector<float> sbuf(kRows * p.G);
  for (int64_t n = n0; n < n1; n += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, n1 - n));
    const float* srow[kRows];
    for (int i = 0; i < kRows; ++i)
      srow[i] = scale_row(p, scale_base(p, n + std::min(i, nr - 1)), sbuf.data() + i * p.G);
    for (int64_t m = 0; m < p.M; m += kMaxMB) {
      switch (std::min<int64_t>(kMaxMB, p.M - m)) {
        case 1: bf16_tiles<D, 1>(p, dec, x, srow, m, n, nr); break;
        case 2: bf16_tiles<D, 2>(p, dec, x, srow, m, n, nr); break;
        case 3: bf16_tiles<D, 3>(p, dec, x, srow, m, n, nr); break;
        default: bf16_tiles<D, 4>(p, dec, x, srow, m, n, nr); break;
      }
    }
  }
}

template <class D> struct DotBf16Fn { static void run(const LowbitArgs& p, int64_t n0, int64_t n1) { dot_bf16<D>(p, n0, n1); } };
template <class D> struct PrefillBf16Fn {
  static void run(const LowbitArgs& p, int64_t n0, int64_t n1) { prefill_bf16<D>(p, n0, n1); }
};
