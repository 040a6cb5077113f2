// The registry of the CPU kernels' descriptions (kernel_descriptions.h) and its JSON form for Python.
//
// Note [Kernel descriptions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchqkit.kernels.status() says, per op, which kernel runs at the selected ISA level and why. Those words are
// written in the op's own C++ file, beside the routes they describe (a DescribeOp at namespace scope), and reach
// Python through torchqkit_cpu::kernel_descriptions() -> str, one JSON object:
//   {"torchqkit::<op>": {"levels": {"<isa>": {"runs": "<isa>", "text": "..."}, ...},
//                        "fp32_in_bf16_from": "M ...", "fp32_planes_from": "M ...", "fp32_prefill_routes": bool}}
// with every level the extension knows, in isa_name's spelling. A level an op registers no text for is the
// level of another kernel, said so here once instead of in every op:
//   avx_vnni     without an AVX-VNNI kernel the AVX2 one runs (the glue's base_isa); the level keeps its name
//   amx          with an AVX512-BF16 kernel, the same kernels with the prefill's bf16 panels on AMX tiles
//   avx512_bf16  without a bf16 kernel the AVX-512 VNNI one runs (vnni_isa), and "runs" names that level;
//   and amx      likewise when the op has neither an AMX nor a bf16 description
// Python adds only what changes per call: the level chosen, torch's fp32 matmul precision, the prefill route.
#include "kernel_descriptions.h"

#include <cstdio>

namespace torchqkit_cpu {
namespace {

std::vector<OpDescription>& registry() {
  static std::vector<OpDescription> descriptions;  // built on first use: DescribeOp objects of other files
  return descriptions;                             // may run before this file's statics
}

constexpr const char* kLevels[] = {"amx", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx2", "scalar"};

const std::string kAvx2AtAvxVnni = "no AVX-VNNI kernel: its AVX2 kernel runs. ";
const std::string kAmxPanels =
    "amx: the avx512_bf16 kernels, but the prefill's bf16 panels multiply on AMX tiles (tdpbf16ps, blocks of "
    "32 tokens x 32 rows, fp32 sums, scales per segment: Note [bf16 panels on AMX]). ";

const std::string* text_at(const OpDescription& d, const std::string& isa) {
  for (const auto& level : d.levels)
    if (level.first == isa) return &level.second;
  return nullptr;
}

// (runs, text) of the op at `isa`, registered or derived as Note [Kernel descriptions] says; runs is "" when the op
// has nothing to say for that level.
std::pair<std::string, std::string> describe_level(const OpDescription& d, const std::string& isa) {
  if (const std::string* own = text_at(d, isa)) return {isa, *own};
  const std::string* avx2 = text_at(d, "avx2");
  const std::string* bf16 = text_at(d, "avx512_bf16");
  const std::string* vnni = text_at(d, "avx512_vnni");
  if (isa == "avx_vnni" && avx2) return {isa, kAvx2AtAvxVnni + *avx2};
  if (isa == "amx" && bf16) return {isa, kAmxPanels + *bf16};
  if ((isa == "avx512_bf16" || isa == "amx") && vnni)
    return {"avx512_vnni",
            "at the " + isa + " level this op has no bf16 dot-product kernel: its AVX-512 VNNI kernel runs: " + *vnni};
  return {"", ""};
}

void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace

DescribeOp::DescribeOp(OpDescription description) { registry().push_back(std::move(description)); }

std::string kernel_descriptions_json() {
  std::string out = "{";
  for (const OpDescription& d : registry()) {
    if (out.size() > 1) out += ", ";
    append_json_string(out, d.op);
    out += ": {\"levels\": {";
    bool first = true;
    for (const char* isa : kLevels) {
      const auto [runs, text] = describe_level(d, isa);
      if (runs.empty()) continue;
      if (!first) out += ", ";
      first = false;
      append_json_string(out, isa);
      out += ": {\"runs\": ";
      append_json_string(out, runs);
      out += ", \"text\": ";
      append_json_string(out, text);
      out += "}";
    }
    out += "}, \"fp32_in_bf16_from\": ";
    append_json_string(out, d.fp32_in_bf16_from);
    out += ", \"fp32_planes_from\": ";
    append_json_string(out, d.fp32_planes_from);
    out += ", \"fp32_prefill_routes\": ";
    out += d.has_fp32_prefill_routes ? "true" : "false";
    out += "}";
  }
  return out + "}";
}

}  // namespace torchqkit_cpu
