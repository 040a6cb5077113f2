// AMX-INT8 sums for the int8 dynamic-activation panels (linear_int8.cpp's da_panel): the `amx` level's replacement
// for the vpdpbusd register tiles at prefill M.
//
// Note [int8 panels on AMX]: da_pack's panel [kc / 4][32][4] is tdpbusd's B operand as it stands: a tile row is one
// k quad for 16 columns (64 bytes), so the panel's left and right 16 columns are two B tiles of 16 quads (64 k), row
// stride 128 bytes. A is 16 rows x 64 shifted u8 codes, packed once per call like the bf16 activations (Note
// [activations packed for AMX]) as [ceil(M / 32)][lda / 64][32 rows][64 k], rows past M zero. One tdpbusd is
// 16 x 16 x 64 exact int32 multiply-adds in 16 cycles, 16x what one zmm vpdpbusd does per cycle. The sums leave the
// tiles through a 32 x 32 int32 buffer into the register kernel's epilogue (the zero point's row-sum term, scales,
// bias), so both give the same int32 sums and the same floats.
//
// A k block's tail past K: da_pack leaves the panel's last quads of a 64-k step unwritten, and the packed codes are
// zero there (quantize_rows zeroes columns K..lda-1), so whatever those bytes hold adds 0.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.h"

namespace torchqkit_cpu {
namespace amx_int8 {

constexpr int kBlockRows = amx::kBlockRows;

// The packed activations' block of rows m0..m0 + 31 (m0 a multiple of 32), lda / 64 k steps per block.
inline const uint8_t* packed_block(const uint8_t* a, int64_t m0, int64_t lda) {
  return a + m0 / kBlockRows * (lda / 64) * (kBlockRows * 64);
}

// sums[0:32][0:32] = A[32 rows, 0:kc) @ panel (int32, exact); kc a multiple of 64 but for the last block of k (see
// above). A's 64-k step s of row r at a + s * step_bytes + r * row_bytes: the packed block at its first k step
// (row_bytes 64, step_bytes 32 * 64) or row-major codes (row_bytes = their row stride, step_bytes 64; 16 rows
// readable from the last 16-row half's first). kTwo: more than 16 rows (tiles 2, 3, 5 in use; else sums rows 16..31
// are untouched). The configuration must be loaded (amx::configure).
template <bool kTwo>
TQK_AMX inline void sums(const uint8_t* a, int64_t row_bytes, int64_t step_bytes, const int8_t* panel, int64_t kc,
                         int32_t (&out)[32][32]) {
  amx::zero_c<kTwo>();
  for (int64_t k = 0; k < kc; k += 64) {
    _tile_loadd(6, panel + k * 32, 128);  // quad row k / 4 of 32 columns x 4 bytes
    _tile_loadd(7, panel + k * 32 + 64, 128);
    const uint8_t* ak = a + k / 64 * step_bytes;
    _tile_loadd(4, ak, row_bytes);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (kTwo) {
      _tile_loadd(5, ak + 16 * row_bytes, row_bytes);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
  amx::store_c<kTwo>(out);
}

// sums<rows > 16>: rows (<= 32) of A.
TQK_AMX inline void sums_rows(int rows, const uint8_t* a, int64_t row_bytes, int64_t step_bytes, const int8_t* panel,
                              int64_t kc, int32_t (&out)[32][32]) {
  if (rows > 16) sums<true>(a, row_bytes, step_bytes, panel, kc, out);
  else sums<false>(a, row_bytes, step_bytes, panel, kc, out);
}

}  // namespace amx_int8
}  // namespace torchqkit_cpu
