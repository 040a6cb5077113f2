// int4 tensor-core tiled weight x half / bf16 activations on tensor cores (mma.sync.m16n8k16, sm80+).
//
// Each warp owns one n-tile (8 output columns) and 16 activation rows; it walks its share of the K range
// one k16-tile at a time:
//   A fragment  straight from global memory at mma_a_coord (csrc/common/dequant.h): lane (g = lane / 4,
//               c = lane % 4) loads x[m0 + g (+8)][k0 + 2c (+8) + {0, 1}], the mma row-major A layout.
//   B fragment  ONE int32 word per lane and k16-tile (int4_tiled_lane_word): TensorCoreTiledLayout stores
//               exactly the lane's b0..b3 codes there (Note [Tensor-core tiled int4]); int4_tiled_pair
//               extracts the two (k, k + 1) code pairs, dequantized with the group's scale and zero.
//               test/kernels/cuda/test_common_helpers.py checks this path on the host against the layout.
//   C fragment  fp32 accumulators, written to part[split][m][n] (the glue sums the K splits, adds bias).
// Prefill: split_k = 1 and the grid covers M in 16-row tiles. Decode (M <= 16): one row tile and split_k
// slices of K so that enough warps stream the weight (the GEMV use of the same kernel).
#include <cstdint>

#include "../common/dequant.h"
#include "act_type.cuh"
#include "kernels.h"

namespace torchqkit_cuda {
namespace {

namespace tc = torchqkit_common;
constexpr int kWarps = 4;  // n-tiles per block

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T> __device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]);
template <> __device__ __forceinline__ void mma_16816<__half>(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two consecutive activations (k even, K % 16 == 0 so they never straddle a row end); zero past M.
template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* x, int64_t ldx, int64_t M, int64_t row, int64_t k) {
  return row < M ? *reinterpret_cast<const uint32_t*>(x + row * ldx + k) : 0u;
}

template <typename T>
__global__ void __launch_bounds__(32 * kWarps) int4_tiled_mma_kernel(const Int4TiledArgs a) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t tile_n = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (tile_n * 8 >= a.N) return;  // the whole warp leaves together (mma.sync needs all 32 lanes)
  const int g = lane / 4;  // groupID: this lane's n within the tile (mma_b_coord(lane, i).col)
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * 16;
  const int64_t k16_tiles = a.K / 16;
  const int64_t per_split = (k16_tiles + a.split_k - 1) / a.split_k;
  const int64_t t_begin = blockIdx.z * per_split;
  const int64_t t_end = t_begin + per_split < k16_tiles ? t_begin + per_split : k16_tiles;
  const T* x = static_cast<const T*>(a.x);
  const T* sz = static_cast<const T*>(a.sz);
  const int64_t n = tile_n * 8 + g;  // the weight row of this lane's B fragment
  const int tiles_per_chunk = 2 * a.words;

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t tt = t_begin; tt < t_end; ++tt) {
    const int64_t k0 = tt * 16;
    // ---- A: register r holds elements 2r, 2r + 1 (rows g / g + 8, columns 2c (+8) + {0, 1}) ----
    uint32_t af[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const tc::MmaCoord at = tc::mma_a_coord(lane, 2 * r);
      af[r] = load_pair(x, a.ldx, a.M, m0 + at.row, k0 + at.col);
    }
    // ---- B: the lane's word of k16-tile t in chunk j, dequantized pair by pair ----
    const int64_t j = tt / tiles_per_chunk;
    const int t = static_cast<int>(tt % tiles_per_chunk);
    const uint32_t word = static_cast<uint32_t>(a.q[tc::int4_tiled_lane_word(tile_n, j, lane, t, a.num_chunks, a.words)]);
    const int64_t s_idx = ((k0 / a.group) * a.N8 + n) * 2;
    const float scale = to_float(sz[s_idx]), zero = to_float(sz[s_idx + 1]);
    const uint32_t p0 = tc::int4_tiled_pair(word, 2 * (t % 2)), p1 = tc::int4_tiled_pair(word, 2 * (t % 2) + 1);
    uint32_t bf[2];
    bf[0] = pack2<T>(tc::int4_dequant(p0 & 0xFFFF, scale, zero), tc::int4_dequant(p0 >> 16, scale, zero));
    bf[1] = pack2<T>(tc::int4_dequant(p1 & 0xFFFF, scale, zero), tc::int4_dequant(p1 >> 16, scale, zero));
    mma_16816<T>(acc, af, bf);
  }
  // ---- C: element i at (m0 + row, 8 tile_n + col) of the fragment layout ----
  float* part = a.part + static_cast<int64_t>(blockIdx.z) * a.M * a.N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const tc::MmaCoord ct = tc::mma_c_coord(lane, i);
    const int64_t row = m0 + ct.row, col = tile_n * 8 + ct.col;
    if (row < a.M && col < a.N) part[row * a.N + col] = acc[i];
  }
}

}  // namespace

void int4_tiled_mma(ActType t, const Int4TiledArgs& a, cudaStream_t stream) {
  const int64_t n_tiles = (a.N + 7) / 8;
  const dim3 grid(static_cast<unsigned>((n_tiles + kWarps - 1) / kWarps), static_cast<unsigned>((a.M + 15) / 16),
                  static_cast<unsigned>(a.split_k));
  if (t == ActType::kHalf) {
    int4_tiled_mma_kernel<__half><<<grid, 32 * kWarps, 0, stream>>>(a);
  } else {
    int4_tiled_mma_kernel<__nv_bfloat16><<<grid, 32 * kWarps, 0, stream>>>(a);
  }
}

}  // namespace torchqkit_cuda
