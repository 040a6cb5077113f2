// Host-side driver for the unit test of dequant.h (test/kernels/cuda/test_common_helpers.py).
//
//   dequant_selftest tables                      every element decoder over its whole code range
//   dequant_selftest tiled FILE N8 CHUNKS WORDS  codes of a tiled int4 qdata (raw little-endian int32)
//   dequant_selftest pairs FILE N8 CHUNKS WORDS  the same codes through the mma fragment view
//   dequant_selftest fragments FILE N8 CHUNKS WORDS  "n k code" for every B-fragment element every lane of
//                                                the mma kernel loads (its word index and pair extraction)
//   dequant_selftest coords                      the A / B / C fragment coordinates of every lane
// Floats are printed as their bit patterns (exact comparison); codes as integers.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dequant.h"

namespace tc = torchqkit_common;

static unsigned bits(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

static std::vector<int32_t> read_words(const char* path, size_t count) {
  std::vector<int32_t> q(count);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(q.data(), 4, count, f) != count) { std::fprintf(stderr, "can't read %s\n", path); std::exit(2); }
  std::fclose(f);
  return q;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "tables") == 0) {
    for (int b = 0; b < 256; ++b) std::printf("e4m3fn %d %08x\n", b, bits(tc::fp8_e4m3fn_to_float(b)));
    for (int b = 0; b < 256; ++b) std::printf("e5m2 %d %08x\n", b, bits(tc::fp8_e5m2_to_float(b)));
    for (int b = 0; b < 256; ++b) std::printf("e4m3fnuz %d %08x\n", b, bits(tc::fp8_e4m3fnuz_to_float(b)));
    for (int b = 0; b < 256; ++b) std::printf("e5m2fnuz %d %08x\n", b, bits(tc::fp8_e5m2fnuz_to_float(b)));
    for (int b = 0; b < 256; ++b) std::printf("e8m0 %d %08x\n", b, bits(tc::e8m0_to_float(b)));
    for (int c = 0; c < 16; ++c) std::printf("e2m1 %d %08x\n", c, bits(tc::fp4_e2m1_to_float(c)));
    for (int c = 0; c < 16; ++c) std::printf("nf4 %d %08x\n", c, bits(tc::nf4_level(c)));
    constexpr float nf4_table[16] = {TORCHQKIT_NF4_LEVELS}, fp4_table[16] = {TORCHQKIT_FP4_E2M1_LEVELS};
    for (int c = 0; c < 16; ++c) std::printf("nf4_table %d %08x\n", c, bits(nf4_table[c]));
    for (int c = 0; c < 16; ++c) std::printf("e2m1_table %d %08x\n", c, bits(fp4_table[c]));
    const uint8_t row[2] = {0x1F, 0xA2};  // nf4: codes 1, 15, 10, 2; mxfp4: 15, 1, 2, 10
    for (int k = 0; k < 4; ++k) std::printf("nf4_code %d %d\n", k, tc::nf4_code(row, k));
    for (int k = 0; k < 4; ++k) std::printf("mxfp4_code %d %d\n", k, tc::mxfp4_code(row, k));
    std::printf("int4_dequant %08x\n", bits(tc::int4_dequant(3, 0.5f, 0.25f)));
    std::printf("nf4_dq_absmax %08x\n", bits(tc::nf4_dq_absmax(-3, 0.125f, 1.0f)));
    return 0;
  }
  if (argc == 6 && (std::strcmp(argv[1], "tiled") == 0 || std::strcmp(argv[1], "pairs") == 0)) {
    const long n8 = std::atol(argv[3]), chunks = std::atol(argv[4]);
    const int words = std::atoi(argv[5]);
    const long kt = chunks * 32 * words;
    const std::vector<int32_t> q = read_words(argv[2], static_cast<size_t>(n8 * kt / 8));
    const bool pairs = argv[1][0] == 'p';
    for (long n = 0; n < n8; ++n) {
      for (long k = 0; k < kt; ++k) {
        int code;
        if (!pairs) {
          code = tc::int4_tiled_code(q.data(), n, k, chunks, words);
        } else {  // what an mma lane sees: the word of its k16-tile, then the pair holding k
          const long rem = k % (32 * words);
          const int t = static_cast<int>(rem / 16), h = static_cast<int>((rem % 16) / 8);
          const int c = static_cast<int>((rem % 8) / 2), e = static_cast<int>(rem % 2);
          const long word = (((n / 8) * chunks + k / (32 * words)) * 32 + 4 * (n % 8) + c) * words + t / 2;
          const uint32_t pair = tc::int4_tiled_pair(static_cast<uint32_t>(q[word]), 2 * (t % 2) + h);
          code = static_cast<int>(e ? pair >> 16 : pair & 0xFFFF);
        }
        std::printf("%d%c", code, k + 1 == kt ? '\n' : ' ');
      }
    }
    return 0;
  }
  if (argc == 6 && std::strcmp(argv[1], "fragments") == 0) {
    const long n8 = std::atol(argv[3]), chunks = std::atol(argv[4]);
    const int words = std::atoi(argv[5]);
    const std::vector<int32_t> q = read_words(argv[2], static_cast<size_t>(n8 / 8 * chunks * 32 * words));
    for (long i = 0; i < n8 / 8; ++i)
      for (long j = 0; j < chunks; ++j)
        for (int t = 0; t < 2 * words; ++t)
          for (int lane = 0; lane < 32; ++lane) {
            const uint32_t word = static_cast<uint32_t>(q[tc::int4_tiled_lane_word(i, j, lane, t, chunks, words)]);
            for (int reg = 0; reg < 2; ++reg) {  // as int4_tiled_mma.cu: pair s = 2 (t % 2) + reg
              const uint32_t pair = tc::int4_tiled_pair(word, 2 * (t % 2) + reg);
              for (int e = 0; e < 2; ++e) {
                const tc::MmaCoord b = tc::mma_b_coord(lane, 2 * reg + e);
                std::printf("%ld %ld %u\n", 8 * i + b.col, 32 * words * j + 16 * t + b.row,
                            e ? pair >> 16 : pair & 0xFFFF);
              }
            }
          }
    return 0;
  }
  if (argc == 2 && std::strcmp(argv[1], "coords") == 0) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int i = 0; i < 8; ++i) std::printf("A %d %d\n", tc::mma_a_coord(lane, i).row, tc::mma_a_coord(lane, i).col);
      for (int i = 0; i < 4; ++i) std::printf("B %d %d\n", tc::mma_b_coord(lane, i).row, tc::mma_b_coord(lane, i).col);
      for (int i = 0; i < 4; ++i) std::printf("C %d %d\n", tc::mma_c_coord(lane, i).row, tc::mma_c_coord(lane, i).col);
    }
    return 0;
  }
  std::fprintf(stderr, "usage: %s tables | coords | tiled|pairs|fragments FILE N8 CHUNKS WORDS\n", argv[0]);
  return 2;
}
