// What each C++ CPU kernel does at each ISA level, in words: the "why" torchqkit.kernels.status() shows for an op.
//
// The words live next to the kernels they describe, so a change to a kernel's routes is one edit: each op's file
// registers its descriptions with a DescribeOp object at namespace scope (run when the library loads), and
// torchqkit_cpu::kernel_descriptions() (registration.cpp) hands all of them to Python as JSON (Note [Kernel
// descriptions] in kernel_descriptions.cpp). No torch header: plain strings.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace torchqkit_cpu {

// Phrases several ops' descriptions end with, one per route choice they describe.
// Note [fp32 prefill by sgemm] in registration.cpp: the AVX-512 levels' choice.
inline const std::string kFp32PrefillSgemm =
    "MKL's sgemm runs near the FMA peak of Intel's two 512-bit pipes, the panels at about half; "
    "TORCHQKIT_CPU_FP32_PREFILL=sgemm|panels forces a route";
// Note [fp32 panels at 256 bits] in sgemm_prefill.h: the AVX2 level's choice.
inline const std::string kFp32PrefillPanels256 =
    "MKL's sgemm runs near the FMA peak on Intel CPUs, and at 0.8x these panels on AMD Zen 5; "
    "TORCHQKIT_CPU_FP32_PREFILL=sgemm|panels forces a route";

// One op's kernels described: the text per ISA level (isa_name's spelling) where the op has a kernel of its own,
// and how float32 activations are routed where that differs between ops.
struct OpDescription {
  explicit OpDescription(std::string op_name) : op(std::move(op_name)) {}

  // What serves the op at `isa`. Levels left out are derived (Note [Kernel descriptions]).
  OpDescription& at(const char* isa, std::string text) {
    levels.emplace_back(isa, std::move(text));
    return *this;
  }
  // The M from which float32 activations take the bf16 prefill under torch's "medium" fp32 matmul precision (Note
  // [fp32 activations in bf16] in fp32_matmul_precision.h), and at the amx level as three bf16 planes (Note [fp32
  // activations on AMX]); "" where they never do.
  OpDescription& fp32_in_bf16(std::string from_m, std::string planes_from_m) {
    fp32_in_bf16_from = std::move(from_m);
    fp32_planes_from = std::move(planes_from_m);
    return *this;
  }
  // The op's float32 prefill chooses between the fp32 panels and ATen's sgemm (Note [fp32 prefill by sgemm]).
  OpDescription& fp32_prefill_routes() {
    has_fp32_prefill_routes = true;
    return *this;
  }

  std::string op;                                         // "torchqkit::<name>"
  std::vector<std::pair<std::string, std::string>> levels;  // (isa, text) as registered
  std::string fp32_in_bf16_from, fp32_planes_from;
  bool has_fp32_prefill_routes = false;
};

// Registers a description at load time: `const DescribeOp kDescribed(OpDescription("torchqkit::op").at(...));`
struct DescribeOp {
  explicit DescribeOp(OpDescription description);
};

// Every registered description, derived levels included, as one JSON object (Note [Kernel descriptions]).
std::string kernel_descriptions_json();

}  // namespace torchqkit_cpu
