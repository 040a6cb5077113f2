// Whether float32 activations may run through the bf16 (vdpbf16ps) kernels: the user allowed it the way torch
// does for its own fp32 matmuls on CPU, with torch.set_float32_matmul_precision("medium") (or
// torch.backends.mkldnn.matmul.fp32_precision = "bf16"). Read on every call, like torch reads it, so a change
// takes effect at once. The default ("highest") keeps every fp32 activation on the fp32 kernels.
//
// Note [fp32 activations in bf16]: under that setting a weight-only op with fp32 activations converts them to bf16
// once per call and takes the bf16 prefill kernels, from the M where those run; at decode M only int4 tiled (its
// bf16 decode kernel needs half the instructions per weight of the fp32 one: Note [int4 bf16 decode]), the other
// formats' fp32 decode kernels read the weight as fast as their bf16 ones. The result is the one bf16 activations
// give, in fp32.
// Only on CPUs with AVX512-BF16 (the selected level is avx512_bf16): elsewhere bf16 compute is slower than fp32.
#pragma once
#include <ATen/Context.h>

namespace torchqkit_cpu {

inline bool fp32_matmul_allows_bf16() {
  return at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL) ==
         at::Float32Precision::BF16;
}

}  // namespace torchqkit_cpu
