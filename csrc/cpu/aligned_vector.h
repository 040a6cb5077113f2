// std::vector whose storage starts on a cache line, for the kernels' scratch buffers.
//
// Note [scratch on cache lines]: malloc aligns to 16 bytes, so a float buffer that vector loads read whole (the int4
// decode's permuted activation, 8 or 16 floats per load) started on a 32- or 64-byte boundary in some processes and
// not in others: then every other 32-byte load crossed a cache line. The AVX2 int4 decode at M = 16 (4096^2, Zen 5)
// ran 3.0 ms in some processes and 3.9 ms in others, stable within each, with the same code and data. On cache lines
// the time no longer depends on where the allocator put the buffer.
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace torchqkit_cpu {

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace torchqkit_cpu
