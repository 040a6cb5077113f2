// AMX (Intel Sapphire Rapids and later: AMX-TILE + AMX-BF16) micro-kernel over the bf16 k-pair panels of
// bf16_gemm.h, the `amx` level's replacement for the vdpbf16ps register tiles at prefill M.
//
// Note [bf16 panels on AMX]: a panel's [kc / 2][32] words are exactly what tdpbf16ps wants for its B operand: a
// tile row is one k pair for 16 columns (64 bytes), so the panel's left and right 16 columns are two B tiles of 16
// k pairs (32 k), row stride 128 bytes. The A operand is 16 activation rows x 32 bf16 (64 bytes), loaded straight
// from the (M, ldx) activations. One tdpbf16ps is 16 x 16 x 32 multiply-adds (16 cycles): 16x what one vdpbf16ps
// zmm does per cycle, and on Intel's cores vdpbf16ps runs at half the fp32 FMA rate (measured on a 2-vCPU Xeon
// with AMX: torch's bf16 F.linear without AMX at 0.7x its fp32 one, with AMX 5.8x), so this is the only bf16 route
// that beats fp32 there. A block of up to 32 activation rows x 32 columns keeps 4 C tiles; per scale segment
// (Note [bf16 panels]) the C tiles start at zero, are stored to an L1 buffer and folded into the fp32 sums with
// the segment's scales, so products and sums round as in the vdpbf16ps kernel.
//
// Note [fp32 activations on AMX]: float32 activations split exactly into three bf16 planes, x = hi + mid + lo
// (hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid: each takes the next 8 significant bits, and bf16 has
// fp32's exponent range). Every panel value is exact in bf16 (integer codes, float8 / fp4 values; nf4's levels are
// the documented exception, Note [nf4 levels in bf16]), so each plane's products are exact and the three
// tdpbf16ps per tile sum them in fp32: the fp32 result up to fp32 rounding of the sums, at 3x the bf16 work, which
// AMX still does several times faster than fp32 FMAs (subnormal planes, |x| < 2^-110, are flushed to zero).
//
// Tile state belongs to the thread and other libraries (oneDNN) load their own configuration, so every
// panel_gemm call loads its configuration before its first tile instruction and releases the tiles at its end.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace torchqkit_cpu {
namespace amx_bf16 {

#define TQK_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

constexpr int kBlockRows = 32;  // activation rows per block: two A tiles of 16

// The palette-1 configuration: C tiles 0, 1 (rows r0) and 2, 3 (rows r1) of 16 fp32; A tiles 4 (r0 rows) and 5
// (r1 rows) of 32 bf16; B tiles 6, 7 of 16 k pairs. r1 = 0 leaves tiles 2, 3, 5 unconfigured.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the configuration for blocks of r0 + r1 rows unless `current` says it is loaded; current = -1 forces it.
TQK_AMX inline void configure(int r0, int r1, int& current) {
  if (current == r0 * 64 + r1) return;
  TileConfig cfg;
  const int tiles_r0[] = {0, 1, 4}, tiles_r1[] = {2, 3, 5};
  for (int t : tiles_r0) cfg.rows[t] = static_cast<uint8_t>(r0), cfg.colsb[t] = 64;
  if (r1 > 0)
    for (int t : tiles_r1) cfg.rows[t] = static_cast<uint8_t>(r1), cfg.colsb[t] = 64;
  cfg.rows[6] = cfg.rows[7] = 16;
  cfg.colsb[6] = cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
  current = r0 * 64 + r1;
}

TQK_AMX inline void release() { _tile_release(); }

// C[0:rows, 0:ncols] (+)= sum over segments s of (A[0:rows, seg s] @ panel[seg s]) * seg_scale[s][0:32], A the sum
// of `planes` bf16 matrices plane_stride elements apart (row stride lda; kc and seg multiples of 32). kTwo: rows >
// 16 (tiles 2, 3, 5 in use). The configuration for these rows must be loaded (configure).
template <bool kTwo>
TQK_AMX void block(int rows, const uint16_t* a, int64_t lda, int planes, int64_t plane_stride, const uint32_t* panel,
                   int64_t kc, int64_t seg, const float* seg_scale, float* c, int64_t ldc, int ncols, bool first) {
  alignas(64) float part[kBlockRows][32];
  alignas(64) float acc[kBlockRows][32];
  const int64_t sa = lda * 2, sb = 32 * 4;  // row strides in bytes: activations, panel
  for (int64_t k0 = 0, si = 0; k0 < kc; k0 += seg, ++si) {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwo) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = k0; k < std::min(k0 + seg, kc); k += 32) {
      _tile_loadd(6, panel + k / 2 * 32, sb);
      _tile_loadd(7, panel + k / 2 * 32 + 16, sb);
      for (int pl = 0; pl < planes; ++pl) {
        const uint16_t* ak = a + pl * plane_stride + k;
        _tile_loadd(4, ak, sa);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (kTwo) {
          _tile_loadd(5, ak + 16 * lda, sa);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
    _tile_stored(0, &part[0][0], 128);
    _tile_stored(1, &part[0][16], 128);
    if (kTwo) {
      _tile_stored(2, &part[16][0], 128);
      _tile_stored(3, &part[16][16], 128);
    }
    const __m512 sc0 = _mm512_loadu_ps(seg_scale + si * 32), sc1 = _mm512_loadu_ps(seg_scale + si * 32 + 16);
    for (int m = 0; m < rows; ++m) {
      const __m512 p0 = _mm512_load_ps(&part[m][0]), p1 = _mm512_load_ps(&part[m][16]);
      _mm512_store_ps(&acc[m][0], si == 0 ? _mm512_mul_ps(p0, sc0) : _mm512_fmadd_ps(p0, sc0, _mm512_load_ps(&acc[m][0])));
      _mm512_store_ps(&acc[m][16], si == 0 ? _mm512_mul_ps(p1, sc1) : _mm512_fmadd_ps(p1, sc1, _mm512_load_ps(&acc[m][16])));
    }
  }
  const __mmask16 m0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? (__mmask16)0xFFFF : ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
  for (int m = 0; m < rows; ++m) {
    float* cr = c + m * ldc;
    __m512 v0 = _mm512_load_ps(&acc[m][0]), v1 = _mm512_load_ps(&acc[m][16]);
    if (!first) {
      v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
      v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
    }
    _mm512_mask_storeu_ps(cr, m0, v0);
    _mm512_mask_storeu_ps(cr + 16, m1, v1);
  }
}

// Every row block of one panel block: M rows of A (row stride lda) in blocks of 32, each configured as needed.
TQK_AMX inline void gemm(int64_t M, const uint16_t* a, int64_t lda, int planes, int64_t plane_stride,
                         const uint32_t* panel, int64_t kc, int64_t seg, const float* seg_scale, float* c, int64_t ldc,
                         int ncols, bool first, int& config) {
  for (int64_t m = 0; m < M; m += kBlockRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, M - m));
    configure(std::min(rows, 16), std::max(rows - 16, 0), config);
    if (rows > 16)
      block<true>(rows, a + m * lda, lda, planes, plane_stride, panel, kc, seg, seg_scale, c + m * ldc, ldc, ncols, first);
    else
      block<false>(rows, a + m * lda, lda, planes, plane_stride, panel, kc, seg, seg_scale, c + m * ldc, ldc, ncols,
                   first);
  }
}

#undef TQK_AMX

}  // namespace amx_bf16
}  // namespace torchqkit_cpu
