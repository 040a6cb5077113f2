// AMX (Intel Sapphire Rapids and later: AMX-TILE + AMX-BF16) micro-kernel over the bf16 k-pair panels of
// bf16_gemm.h, the `amx` level's replacement for the vdpbf16ps register tiles at prefill M.
//
// Note [bf16 panels on AMX]: a panel's [kc / 2][32] words are exactly what tdpbf16ps wants for its B operand: a
// tile row is one k pair for 16 columns (64 bytes), so the panel's left and right 16 columns are two B tiles of 16
// k pairs (32 k), row stride 128 bytes. The A operand is 16 activation rows x 32 bf16 (64 bytes), from activations
// packed per call (Note [activations packed for AMX]). One tdpbf16ps is 16 x 16 x 32 multiply-adds (16 cycles):
// 16x what one vdpbf16ps zmm does per cycle, and on Intel's cores vdpbf16ps runs at half the fp32 FMA rate
// (measured on a 2-vCPU Xeon with AMX: torch's bf16 F.linear without AMX at 0.7x its fp32 one, with AMX 5.8x), so
// this is the only bf16 route that beats fp32 there. A block of up to 32 activation rows x 32 columns keeps 4 C
// tiles; per scale segment (Note [bf16 panels]) the C tiles start at zero, are stored to an L1 buffer and folded
// into the fp32 sums with the segment's scales, so products and sums round as in the vdpbf16ps kernel.
//
// Note [fp32 activations on AMX]: float32 activations split exactly into three bf16 planes, x = hi + mid + lo
// (hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid: each takes the next 8 significant bits, and bf16 has
// fp32's exponent range). Every panel value is exact in bf16 (integer codes, float8 / fp4 values; nf4's levels are
// the documented exception, Note [nf4 levels in bf16]), so each plane's products are exact and the three
// tdpbf16ps per tile sum them in fp32: the fp32 result up to fp32 rounding of the sums, at 3x the bf16 work, which
// AMX still does several times faster than fp32 FMAs (subnormal planes, |x| < 2^-110, are flushed to zero).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"

namespace torchqkit_cpu {
namespace amx_bf16 {

using amx::kBlockRows;
using amx::configure;

// Note [activations packed for AMX]: a tile load reads 16 rows of 64 bytes; from (M, K) activations those are 16
// cache lines 2 K bytes apart (with K = 4096 all in one L1 set). At the amx level the glue packs the activations
// once per call as [ceil(M / 32)][ldx / 32][planes][32 rows][32 k] bf16, rows past M zero: each tile is 1 KiB
// contiguous (row stride 64 bytes), a block's loads run through memory in order, and whole 32-row blocks let one
// tile configuration serve every block. By itself that changed little (a float32 call at M = 256, 4096^2: 23.7 ->
// 23.0 ms): what limited the planes was how often the activations stream from L2 / L3 (Note [two panels per A
// tile], Note [AMX panel blocking] in bf16_gemm.h) and the split itself (pack_fp32_planes).

// C[0:rows, 0:ncols] (+)= sum over segments s of (A[0:rows, k0 + seg s] @ panel[seg s]) * seg_scale[s][0:32]: A one
// packed block (Note [activations packed for AMX]) of `planes` planes that sum to the activations, ldx / 32 k steps
// per block; kc and seg multiples of 32. kTwo: rows > 16 (tiles 2, 3, 5 in use).
template <bool kTwo>
TQK_AMX void block(int rows, const uint16_t* a, int planes, int64_t k0, const uint32_t* panel, int64_t kc,
                   int64_t seg, const float* seg_scale, float* c, int64_t ldc, int ncols, bool first) {
  alignas(64) float part[kBlockRows][32];
  alignas(64) float acc[kBlockRows][32];
  constexpr int64_t sa = 64, sb = 32 * 4;  // row strides in bytes: packed activations, panel
  for (int64_t s0 = 0, si = 0; s0 < kc; s0 += seg, ++si) {
    amx::zero_c<kTwo>();
    for (int64_t k = s0; k < std::min(s0 + seg, kc); k += 32) {
      _tile_loadd(6, panel + k / 2 * 32, sb);
      _tile_loadd(7, panel + k / 2 * 32 + 16, sb);
      const uint16_t* ak = a + (k0 + k) / 32 * planes * (kBlockRows * 32);
      for (int pl = 0; pl < planes; ++pl, ak += kBlockRows * 32) {
        _tile_loadd(4, ak, sa);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (kTwo) {
          _tile_loadd(5, ak + 16 * 32, sa);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
    amx::store_c<kTwo>(part);
    const __m512 sc0 = _mm512_loadu_ps(seg_scale + si * 32), sc1 = _mm512_loadu_ps(seg_scale + si * 32 + 16);
    for (int m = 0; m < rows; ++m) {
      const __m512 p0 = _mm512_load_ps(&part[m][0]), p1 = _mm512_load_ps(&part[m][16]);
      _mm512_store_ps(&acc[m][0],
                      si == 0 ? _mm512_mul_ps(p0, sc0) : _mm512_fmadd_ps(p0, sc0, _mm512_load_ps(&acc[m][0])));
      _mm512_store_ps(&acc[m][16],
                      si == 0 ? _mm512_mul_ps(p1, sc1) : _mm512_fmadd_ps(p1, sc1, _mm512_load_ps(&acc[m][16])));
    }
  }
  const __mmask16 m0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
  const __mmask16 m1 =
      ncols >= 32 ? (__mmask16)0xFFFF : ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
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

// Note [two panels per A tile]: block() reads each A tile for 32 columns (one panel), so A streams from L2 once per
// panel. Three planes make that stream 3x (6 KiB per 32-k step of a block for 12 tdpbf16ps) and it, not the tiles,
// set the speed: pointing the three planes at one copy (A from L1) took the float32 call from 23 to 13.5 ms (M =
// 256, 4096^2, 2 threads). With planes, the amx panel loop therefore runs its panels in pairs through block64, 16
// rows x 64 columns: each A tile is loaded for the left panel and again, now from L1, for the right one, halving
// the stream from L2 (23 -> 19.5 ms; one plane, where the stream is a third, stays with block(): 6.6 vs 7.3 ms).
//
// One 32-k step of one panel (its row pair kp at `panel`) for 16 rows, every plane: C tiles 0, 1 (kRight: 2, 3)
// += A @ B. The tile intrinsics take their tile numbers as literal text, hence the two spelled-out branches.
template <bool kRight>
TQK_AMX inline void panel_step(const uint32_t* panel, const uint16_t* a, int planes) {
  _tile_loadd(6, panel, 32 * 4);
  _tile_loadd(7, panel + 16, 32 * 4);
  for (int pl = 0; pl < planes; ++pl) {
    _tile_loadd(4, a + pl * (kBlockRows * 32), 64);
    if constexpr (kRight) {
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
}

// Two panels (64 columns) for 16 rows: C tiles 0, 1 (left panel) and 2, 3 (right panel), one A tile per plane.
// a: the packed block holding these rows, half = 0 / 1 their 16-row half. Otherwise as block().
TQK_AMX inline void block64(int rows, const uint16_t* a, int half, int planes, int64_t k0,
                            const uint32_t* const (&panel)[2], int64_t kc, int64_t seg,
                            const float* const (&seg_scale)[2], float* c, int64_t ldc, const int (&ncols)[2],
                            bool first) {
  alignas(64) float part[16][64];
  alignas(64) float acc[16][64];
  for (int64_t s0 = 0, si = 0; s0 < kc; s0 += seg, ++si) {
    amx::zero_c<true>();
    for (int64_t k = s0; k < std::min(s0 + seg, kc); k += 32) {
      const uint16_t* ak = a + (k0 + k) / 32 * planes * (kBlockRows * 32) + half * 16 * 32;
      panel_step<false>(panel[0] + k / 2 * 32, ak, planes);
      panel_step<true>(panel[1] + k / 2 * 32, ak, planes);
    }
    _tile_stored(0, &part[0][0], 256);
    _tile_stored(1, &part[0][16], 256);
    _tile_stored(2, &part[0][32], 256);
    _tile_stored(3, &part[0][48], 256);
    __m512 sc[4];
    for (int q = 0; q < 4; ++q) sc[q] = _mm512_loadu_ps(seg_scale[q / 2] + si * 32 + (q % 2) * 16);
    for (int m = 0; m < rows; ++m)
      for (int q = 0; q < 4; ++q) {
        const __m512 pq = _mm512_load_ps(&part[m][16 * q]);
        _mm512_store_ps(&acc[m][16 * q], si == 0 ? _mm512_mul_ps(pq, sc[q])
                                                  : _mm512_fmadd_ps(pq, sc[q], _mm512_load_ps(&acc[m][16 * q])));
      }
  }
  __mmask16 mask[4];
  for (int q = 0; q < 4; ++q) {
    const int n = ncols[q / 2] - (q % 2) * 16;
    mask[q] = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
  }
  for (int m = 0; m < rows; ++m)
    for (int q = 0; q < 4; ++q) {
      float* cq = c + m * ldc + 16 * q;
      __m512 v = _mm512_load_ps(&acc[m][16 * q]);
      if (!first) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[q], cq));
      _mm512_mask_storeu_ps(cq, mask[q], v);
    }
}

// Every row block of one panel block (k [k0, k0 + kc)): M rows of the packed activations a (ldx / 32 k steps).
// With a second panel (panel[1] != nullptr, columns 32..63 of c) the 64-column kernel runs, 16 rows at a time.
TQK_AMX inline void gemm(int64_t M, const uint16_t* a, int64_t ldx, int planes, int64_t k0,
                         const uint32_t* const (&panels)[2], int64_t kc, int64_t seg, const float* const (&scales)[2],
                         float* c, int64_t ldc, const int (&ncols)[2], bool first, bool& configured) {
  configure(configured);
  const int64_t block_elems = ldx / 32 * planes * (kBlockRows * 32);
  if (panels[1] != nullptr) {
    for (int64_t m = 0; m < M; m += 16) {
      const int rows = static_cast<int>(std::min<int64_t>(16, M - m));
      block64(rows, a + m / kBlockRows * block_elems, static_cast<int>(m % kBlockRows / 16), planes, k0, panels, kc,
              seg, scales, c + m * ldc, ldc, ncols, first);
    }
    return;
  }
  const uint32_t* panel = panels[0];
  const float* seg_scale = scales[0];
  const int nc = ncols[0];
  for (int64_t m = 0; m < M; m += kBlockRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, M - m));
    const uint16_t* am = a + m / kBlockRows * block_elems;
    if (rows > 16)
      block<true>(rows, am, planes, k0, panel, kc, seg, seg_scale, c + m * ldc, ldc, nc, first);
    else
      block<false>(rows, am, planes, k0, panel, kc, seg, seg_scale, c + m * ldc, ldc, nc, first);
  }
}

}  // namespace amx_bf16
}  // namespace torchqkit_cpu
