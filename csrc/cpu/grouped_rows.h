// The grouped weight-only ops' shared loop: rows [offs[g - 1], offs[g]) of x through expert g's 2-d kernel.
//
// Note [Grouped linear in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A mixture-of-experts layer runs a few experts per token: at decode, 4 routed experts x 2 matmuls per layer, each a
// small linear (1280 x 1024 at int4 with float16 scales: 17 us from cache, 35 us from DRAM on a 2-vCPU Zen 5). Run
// from Python (Note [Grouped quantized linear] in torchqkit/tensor/grouped_linear.py), every expert call would also
// build a 2-d tensor subclass and go through the layout's route choice and the dispatcher: tens of microseconds
// each, more than the kernel. The grouped ops
// (torchqkit::grouped_linear_<format>) take the whole stack and the group ends and run the same 2-d kernels from C++,
// each on a view of its expert (select on dim 0: no copy) with its own measured routes, side by side or one after
// another (Note [Decoding experts side by side]); groups without rows are skipped, so a decode step reads only the
// routed experts' bytes. The results are exactly the 2-d op's, expert by expert.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"

#include "kernel_descriptions.h"

namespace torchqkit_cpu {

// The most rows an expert may have for the experts to run side by side, one per thread (Note [Decoding experts side
// by side]): the decode kernels' range (up to 4 tokens per pass).
constexpr int64_t kSideBySideMaxRows = 4;

// out (M, N) in x's dtype: rows [start, end) of group g are `linear(x_rows, g)` (a (rows, N) tensor), start the
// previous group's end (or 0), rows past the last group's end zeros. offs: E non-decreasing int64 / int32 group ends
// on the CPU, each <= M.
template <class ExpertLinear>
at::Tensor grouped_rows(const char* op, const at::Tensor& x, const at::Tensor& offs, int64_t experts, int64_t N,
                        ExpertLinear&& linear) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-d (tokens, features), got shape ", x.sizes());
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == experts && (offs.scalar_type() == at::kLong ||
                                                             offs.scalar_type() == at::kInt),
              op, ": offs must be ", experts, " int64 / int32 group ends (one per expert), got ", offs.scalar_type(),
              " ", offs.sizes());
  const at::Tensor ends = offs.to(at::kLong).contiguous();
  const int64_t* end = ends.data_ptr<int64_t>();
  const int64_t M = x.size(0);
  at::Tensor out = at::zeros({M, N}, x.options());
  std::vector<int64_t> groups;  // the groups with rows
  int64_t most_rows = 0;
  for (int64_t g = 0, start = 0; g < experts; ++g) {
    TORCH_CHECK(end[g] <= M && (g == 0 || end[g] >= end[g - 1]), op, ": group ends must be non-decreasing and at "
                "most the ", M, " rows of x; offs[", g, "] = ", end[g]);
    if (end[g] > start) groups.push_back(g), most_rows = std::max(most_rows, end[g] - start);
    start = end[g];
  }
  auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = groups[i], start = g == 0 ? 0 : end[g - 1];
      out.narrow(0, start, end[g] - start).copy_(linear(x.narrow(0, start, end[g] - start), g));
    }
  };
  // Note [Decoding experts side by side]: a few rows per expert (a decode step) makes each expert a small GEMV whose
  // time is mostly ramping up the stream of a cold matrix and joining the threads at its end. With a multiple of the
  // thread count of such experts (so that every thread gets as many), each thread runs whole experts on its own (the
  // 2-d kernel runs serially inside a parallel region), streaming one matrix after another with no join between
  // them: four cold 1280 x 1024 int4 experts (float16 scales) read at 42 GB/s this way, 36 GB/s one after another
  // over two threads (2-vCPU Zen 5). More rows per expert keep the experts one after another over all threads.
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && !at::in_parallel_region() && most_rows <= kSideBySideMaxRows &&
      (int64_t)groups.size() >= threads && (int64_t)groups.size() % threads == 0) {
    // The caller's inference and grad mode, which the pool's threads don't inherit (the results are made and
    // written there). Only those two: handing over the whole at::ThreadLocalState made the op fail inside a compiled
    // decode step (inductor's C++ wrapper, AVX2 level).
    const bool inference = c10::InferenceMode::is_enabled(), grad = at::GradMode::is_enabled();
    at::parallel_for(0, (int64_t)groups.size(), 1, [&](int64_t i0, int64_t i1) {
      if (inference) {
        c10::InferenceMode guard;
        run(i0, i1);
      } else {
        at::AutoGradMode guard(grad);
        run(i0, i1);
      }
    });
  } else {
    run(0, (int64_t)groups.size());
  }
  return out;
}

// What kernels.status() says of a grouped op: the same loop at every level, over `expert_op`'s kernels of the level.
inline OpDescription grouped_description(const char* op, const char* expert_op) {
  const std::string text = std::string("the experts with rows, each through ") + expert_op +
                           "'s kernels of this level on a view of that expert (Note [Grouped linear in C++]): with up "
                           "to 4 rows each and a multiple of the thread count of them, side by side, one thread "
                           "each; else one after another over all threads. Experts without rows are not read";
  OpDescription d(op);
  for (const char* isa : {"amx", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx2", "scalar"}) d.at(isa, text);
  return d;
}

}  // namespace torchqkit_cpu
