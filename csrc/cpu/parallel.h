// at::parallel_for for the CPU kernels, refusing a build in which it would run on one thread.
//
// ATen's parallel_for is an inline template (ATen/ParallelOpenMP.h): it forks threads only when the
// translation unit itself is compiled with OpenMP (_OPENMP defined). Without -fopenmp it quietly runs
// the whole range on the calling thread, which halved every kernel's speed on a 2-core machine before
// this check existed. setup.py passes -fopenmp; a build without it fails here instead of running slow.
#pragma once
#include <ATen/Parallel.h>

#ifndef _OPENMP
#error "torchqkit's CPU kernels need -fopenmp: without it at::parallel_for runs on one thread (see setup.py)"
#endif

#include <algorithm>
#include <cstdint>

namespace torchqkit_cpu {

// Rows per work item when N rows are split over the threads in items of at most max_rows, a multiple of unit (capped
// at max_rows). at::parallel_for hands each thread a run of ceil(items / threads) items, so the busiest thread does
// that many items of the size chosen: the size is the largest whose busiest thread has no more than 5% above the
// least work found (smaller items cost more per row in the kernels, hence the largest). With fixed items, N = 192
// in items of 128 rows ran 128 and 64 rows on two threads, and the int4 prefill's items of 192 rows ran one item on
// one thread.
inline int64_t balanced_rows(int64_t N, int64_t max_rows, int64_t unit) {
  unit = std::min(unit, max_rows);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t units = (N + unit - 1) / unit, max_units = std::max<int64_t>(1, max_rows / unit);
  auto busiest = [&](int64_t r) { return ((units + r - 1) / r + threads - 1) / threads * r; };
  int64_t least = busiest(max_units);
  for (int64_t r = max_units - 1; r >= 1; --r) least = std::min(least, busiest(r));
  int64_t r = max_units;
  while (r > 1 && busiest(r) * 100 > least * 105) --r;
  return r * unit;
}

}  // namespace torchqkit_cpu
