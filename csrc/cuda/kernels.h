// Plain-C++ interface between the ATen glue (registration.cpp) and the CUDA kernels (*.cu).
//
// The .cu files include no torch header (nvcc compiles them in seconds per architecture); they see raw
// device pointers, sizes and a stream. Activations and outputs share one element type (ActType).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

namespace torchqkit_cuda {

enum class ActType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2 };

// int4 tensor-core tiled (Note [Tensor-core tiled int4]) x half / bf16 activations, mma.sync m16n8k16.
// Writes fp32 partial sums part[split][m][n] for split in [0, split_k); the glue sums them and adds bias.
struct Int4TiledArgs {
  const void* x;            // (M, K) half / bf16, row stride ldx
  int64_t M, K, ldx;
  const int32_t* q;         // [N8 / 8][num_chunks][32][words] int32
  int64_t num_chunks;
  int words;                // inner_k_tiles / 2
  int64_t N, N8;
  const void* sz;           // [Kt / group][N8][2] in the activation type: scale, zero
  int64_t group;
  float* part;              // (split_k, M, N) fp32
  int split_k;
};
void int4_tiled_mma(ActType t, const Int4TiledArgs& a, cudaStream_t stream);

// NF4 dequant-GEMV (small M): one warp per output row, codes decoded in registers.
struct Nf4Args {
  const void* x;            // (M, K), row stride ldx
  int64_t M, K, ldx;
  const uint8_t* q;         // (N, K / 2), two codes per byte
  int64_t N, block;         // NF4 block along K
  const float* absmax;      // (N, K / block) or nullptr with double quantization
  const int8_t* absmax_codes;     // double quantization: (N, K / block)
  const float* absmax_scale;      // (ceil(N * K / block / 256))
  const float* absmax_offset;     // (1)
  const float* bias;        // (N) fp32 or nullptr
  void* out;                // (M, N), row stride ldo
  int64_t ldo;
};
void nf4_gemv(ActType t, const Nf4Args& a, cudaStream_t stream);

// float8 weight-only GEMV: w = float(q) * scale[n / bn][k / bk]. The fnuz kinds are AMD's (Note [float8 fnuz] in
// torchqkit/core/qdtype.py).
enum class Fp8Kind : int { kE4m3fn = 0, kE5m2 = 1, kE4m3fnuz = 2, kE5m2fnuz = 3 };
struct Fp8Args {
  const void* x;            // (M, K), row stride ldx
  int64_t M, K, ldx;
  const uint8_t* q;         // (N, K) float8 bytes
  Fp8Kind kind;             // which float8 the bytes are
  int64_t N;
  const float* scale;       // (N / bn, K / bk)
  int64_t bn, bk, scale_cols;
  const float* bias;        // (N) fp32 or nullptr
  void* out;                // (M, N), row stride ldo
  int64_t ldo;
};
void fp8_gemv(ActType t, const Fp8Args& a, cudaStream_t stream);

}  // namespace torchqkit_cuda
