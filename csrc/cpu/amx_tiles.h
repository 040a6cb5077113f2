// The AMX tiles both AMX paths use (amx_bf16_gemm.h: bf16 panels; linear_int8.cpp: the int8 dynamic-activation
// panels): one configuration, loaded per call, and the 32-row blocks the activations are packed in.
//
// Tile state belongs to the thread and other libraries (oneDNN) load their own configuration, so every call that
// runs tiles loads ours before its first tile instruction and releases the tiles at its end.
#pragma once
#include <immintrin.h>

#include <cstdint>

#define TQK_AMX                                                                                           \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni," \
                        "avx2,fma,f16c")))

namespace torchqkit_cpu {
namespace amx {

constexpr int kBlockRows = 32;  // activation rows per block: two A tiles of 16

struct alignas(64) TileConfig {  // palette 1's 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The palette-1 configuration of every block: C tiles 0..3 (16 x 16 fp32 / int32), A tiles 4, 5 (16 rows x 64
// bytes: 32 bf16 or 64 u8), B tiles 6, 7 (16 rows of 64 bytes: k pairs or quads for 16 columns). Packed blocks
// are whole 32 rows (zero past M), so one configuration serves every block; `loaded` says it is in place.
TQK_AMX inline void configure(bool& loaded) {
  if (loaded) return;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12's names only the first 8 bytes of the configuration as its memory operand, so the
  // compiler dropped the stores of rows and colsb as dead and every tile instruction faulted (SIGILL). The whole
  // 64 bytes are the operand here.
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  loaded = true;
}

TQK_AMX inline void release() { _tile_release(); }

// C tiles 0, 1 (and with kTwo 2, 3) to zero.
template <bool kTwo>
TQK_AMX inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  if (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

// C tiles to a [32][32] block of 4-byte sums (fp32 or int32): 0, 1 the left / right 16 columns of rows 0..15, 2, 3
// those of rows 16..31 (kTwo only).
template <bool kTwo>
TQK_AMX inline void store_c(void* out) {
  char* o = static_cast<char*>(out);
  _tile_stored(0, o, 128);
  _tile_stored(1, o + 64, 128);
  if (kTwo) {
    _tile_stored(2, o + 16 * 128, 128);
    _tile_stored(3, o + 16 * 128 + 64, 128);
  }
}

}  // namespace amx
}  // namespace torchqkit_cpu
