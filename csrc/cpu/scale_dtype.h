// Scales (and float zero points) read as stored, in float32, bfloat16 or float16, one element at a time: what the
// two int4 ops (linear_int4wo_tiled.cpp, linear_int8da_int4_packed.cpp) share, so neither converts its scales per
// call.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace torchqkit_cpu {

enum class SzType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while ((m & 0x400) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element off of a float32 / bfloat16 / float16 array, as float.
inline float load_float(const void* base, SzType t, int64_t off) {
  switch (t) {
    case SzType::kF32: return static_cast<const float*>(base)[off];
    case SzType::kBF16: {
      const uint32_t bits = (uint32_t) static_cast<const uint16_t*>(base)[off] << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    default: return half_to_float(static_cast<const uint16_t*>(base)[off]);
  }
}

// The SzType of a scale tensor's dtype; any other dtype is an error naming op.
inline SzType sz_type(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return SzType::kF32;
    case at::kBFloat16: return SzType::kBF16;
    case at::kHalf: return SzType::kF16;
    default: TORCH_CHECK(false, op, ": scale_and_zero must be float32, bfloat16 or float16, got ", t);
  }
}

}  // namespace torchqkit_cpu
