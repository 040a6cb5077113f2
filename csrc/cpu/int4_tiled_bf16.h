// The int4 tiled weight-only prefill with bf16 activations on AVX512-BF16: TensorCoreTiledLayout words decoded to
// their codes minus 8 (-8..7, exact in bf16) in natural k order, into the k-pair panels of bf16_gemm.h.
//
// NO include guard on purpose: linear_int4wo_tiled.cpp includes this file once, inside its AVX512-BF16 `#pragma GCC
// target` region (namespace avx512_bf16), after Int4Args and sz_at.
//
// Note [int4 tiled in bf16]: with codes u, group scale s and float zero z, w = (u - 8) s + z (Note [int4 tiled
// math]), so y[m, n] = sum_g s[n, g] * (x[m, group g] . (u - 8)) + sum_g xsum[m, g] z[n, g]. The panels hold
// u - 8, bf16_gemm's segments are the groups (natural k order keeps each group contiguous; the fp32 prefill's
// permuted order mixes up to 4 groups per chunk), and the zero term is the panel loop's group term. Products
// exact, sums fp32: the only rounding beyond the fp32 path's is the activations' own bf16.
//
// Natural order from the tiles (Note [Tensor-core tiled int4]): the 32 k at 32 w' of a chunk (u, h, c, e all
// varying, w = w') are the 4 words c * (T / 2) + w' of the row's 2 T words, nibble p = 4 e + 2 u + h of word c
// holding k = 16 u + 8 h + 2 c + e. The row's 2 T words (<= 32 half-words) sit in one zmm; per 32 k:
//   vpermw   lane k <- half-word 2 (c (T / 2) + w') + e   (the half-word holding that nibble)
//   vpsrlvw  lane k >> 4 (2 u + h)                        (the nibble to the bottom)
//   vpermw   the 16 bf16 values u - 8, twice (bits 4.. of the index are the next nibble: ignored / repeated)

struct Int4Bf16Decoder {
  __m512i gather[4];  // per 32-k step w' of a chunk (T / 2 of them)
  __m512i shift;
  __m512i table;
  explicit Int4Bf16Decoder(int64_t T) {
    alignas(64) int16_t gi[4][32], sh[32];
    for (int k = 0; k < 32; ++k) {
      const int e = k & 1, c = (k >> 1) & 3, h = (k >> 3) & 1, u = k >> 4;
      sh[k] = (int16_t)(4 * (2 * u + h));
      for (int w = 0; w < 4; ++w) gi[w][k] = (int16_t)(2 * (c * (T / 2) + w) + e);
    }
    for (int w = 0; w < 4; ++w) gather[w] = _mm512_load_si512(gi[w]);
    shift = _mm512_load_si512(sh);
    alignas(64) float lv[16];
    for (int i = 0; i < 16; ++i) lv[i] = (float)(i - 8);
    table = bf16_gemm::to_bf16(_mm512_load_ps(lv), _mm512_load_ps(lv));
  }
  // Step w of a row's words (rw: its 2 T words of one chunk, in the low lanes) -> 32 bf16 codes - 8, k order.
  __m512i step(__m512i rw, int w) const {
    const __m512i half = _mm512_permutexvar_epi16(gather[w], rw);
    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(half, shift), table);
  }
};

// Rows [b0, b0 + nb) x k [k0, k0 + kc) (whole chunks) -> panel (codes - 8) and segment (= group) scales.
void fill_panel(const Int4Args& p, const Int4Bf16Decoder& dec, int64_t b0, int nb, int64_t k0, int64_t kc,
                uint32_t* panel, float* sc) {
  const int64_t T = p.T, chunk = 16 * T, rows_stored = 8 * p.NT;
  const __mmask16 words = (__mmask16)((1u << (2 * T)) - 1);
  for (int j0 = 0; j0 < bf16_gemm::kPanelCols; j0 += 16) {
    const int32_t* src[16];  // row n's words in chunk 0: n-tile n / 8, row n % 8 of its blocks
    for (int i = 0; i < 16; ++i) {
      const int64_t n = b0 + j0 + i;
      src[i] = j0 + i < nb && n < rows_stored ? p.q + (n / 8) * p.ldq + 2 * T * (n % 8) : nullptr;
    }
    for (int64_t j = k0 / chunk; j < (k0 + kc) / chunk; ++j) {
      __m512i rw[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) rw[i] = src[i] ? _mm512_maskz_loadu_epi32(words, src[i] + j * chunk) : _mm512_setzero_si512();
      for (int w = 0; w < T / 2; ++w) {
        __m512i r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) r[i] = src[i] ? dec.step(rw[i], w) : _mm512_setzero_si512();
        bf16_gemm::store_pairs16(r, panel, (chunk * j + 32 * w - k0) / 2, j0);
      }
    }
  }
  const int64_t nseg = kc / p.g;  // segments are whole groups: g <= 256 divides the 256-k block and Kt
  for (int j = 0; j < bf16_gemm::kPanelCols; ++j)
    for (int64_t s = 0; s < nseg; ++s) sc[s * bf16_gemm::kPanelCols + j] = j < nb ? sz_at(p, k0 / p.g + s, b0 + j, 0) : 0.f;
}

// Rows [n0, n1) of out = a (M, ldx bf16 per plane, zero past K) @ W^T + zero term + bias; xsum (M, G) the per-group
// sums of the activations the planes add up to.
void prefill(const Int4Args& p, const Bf16Activations& a, const float* xsum, int64_t n0, int64_t n1) {
  const Int4Bf16Decoder dec(p.T);
  const int64_t Kt = p.NC * 16 * p.T;
  const bf16_gemm::PanelProblem pb{a.ptr(), p.M,    a.ldx, Kt,  bf16_gemm::panel_block_k(p.g), p.g, p.out,
                                   p.ldo,   p.bias, xsum,  p.G, a.planes};
  bf16_gemm::panel_gemm(
      pb, n0, n1,
      [&](int64_t b0, int nb, int64_t k0, int64_t kc, uint32_t* panel, float* sc) {
        fill_panel(p, dec, b0, nb, k0, kc, panel, sc);
      },
      [&](int64_t b0, int nb, float* zp) {
        for (int j = 0; j < bf16_gemm::kPanelCols; ++j)
          for (int64_t gi = 0; gi < p.G; ++gi) zp[gi * bf16_gemm::kPanelCols + j] = j < nb ? sz_at(p, gi, b0 + j, 1) : 0.f;
      });
}
