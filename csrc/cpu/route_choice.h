// Kernel routes chosen by measurement (Note [Routes chosen by measurement], route_choice.cpp).
//
// Where an op has more than one exact way to compute a case, it asks take_route() at the point of choice; the op's
// entry point runs its body under measured_routes(), which times the choices the body asked about the first time a
// case (op, level, dtype, class of M, weight shape, threads) runs and keeps the fastest for the process.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace torchqkit_cpu {

// The points of choice. Their names, pin variables and choices: kSites in route_choice.cpp.
enum class RouteSite : int { kFp32Prefill = 0, kInt4Decode = 1 };
constexpr int kRouteSites = 2;

// Choices at RouteSite::kFp32Prefill (Note [fp32 prefill by sgemm], registration.cpp): at the avx512_vnni level the
// op's own fp32 panels vs rows dequantized for ATen's sgemm; at the avx2 level rows dequantized for the 256-bit
// panels vs for ATen's sgemm.
enum Fp32PrefillRoute : int { kPanelsRoute = 0, kSgemmRoute = 1 };
// Choices at RouteSite::kInt4Decode (the int4 tiled op at M = 1): the float32 dot kernel of the level, the int16-pair
// integer kernel (Note [int4 decode on int16 pairs]), the bf16 kernel where torch's fp32 matmul precision allows it.
enum Int4DecodeRoute : int { kFloatDecode = 0, kInt16Decode = 1, kBf16Decode = 2 };

constexpr unsigned route_bit(int choice) { return 1u << choice; }

// The choice to take at `site`, where the choices in `candidates` (route_bit's) can serve and the op's rule (what it
// takes unmeasured) is `rule`: the one the site's environment variable pins, when it is a candidate; else the one
// being timed or measured fastest for the calling op's case; else `rule`. Read on every call, like
// TORCHQKIT_CPU_ISA, so tests switch pins in-process.
int take_route(RouteSite site, unsigned candidates, int rule);

// What identifies a case: the op, the level its kernels run, the activations' dtype, the rows M (kept by class: 1,
// 2-3, 4-7, ...), the weight's N and K, and one op-specific number (group size, format) that changes the kernels'
// speed. The thread count and torch's fp32 matmul precision are added by measured_routes.
struct RouteCase {
  const char* op;
  int isa;
  int dtype;
  int64_t m, n, k, extra;
};

// An op's body as measured_routes calls it: a reference to the caller's lambda, not a copy (std::function would
// allocate its captures on every op call).
class RouteBody {
 public:
  template <class F>
  RouteBody(F&& f) : fn_(&f), call_([](void* fn) { return (*static_cast<std::remove_reference_t<F>*>(fn))(); }) {}
  at::Tensor operator()() const { return call_(fn_); }

 private:
  void* fn_;
  at::Tensor (*call_)(void*);
};

// Runs `body`, an op's whole computation (no effect but its result), under the routes chosen for `c`; the first
// call of a case whose body asks take_route() about a site with two or more candidates times each candidate and
// returns the fastest one's result. TORCHQKIT_CPU_ROUTES=rules turns the measuring off.
at::Tensor measured_routes(const RouteCase& c, RouteBody body);

// The routes chosen so far, as a JSON list (kernels.routes()); forget them all (tests); add ones saved by
// routes_json() (kernels.load_routes(): lines of "key\tsite\tchoice").
std::string routes_json();
void clear_routes();
int64_t add_routes(const std::string& lines);

}  // namespace torchqkit_cpu
