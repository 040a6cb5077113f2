// Kernel routes chosen by measurement: the table of choices, the timing, the pins.
//
// Note [Routes chosen by measurement]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Some cases have more than one exact route, and which is faster depends on the CPU more than on anything a rule can
// read: the float32 prefill's own fp32 panels against rows dequantized for ATen's sgemm (MKL's sgemm runs near the
// FMA peak of Intel's two 512-bit pipes, the panels won on AMD Zen 4 and Zen 5), the int4 decode's float32 kernel
// against its int16-pair integer kernel (fewer instructions per weight; a Zen 4 runs 512-bit vectors as two
// halves), and the bf16 decode where torch's fp32 matmul precision allows it. So an op asks take_route() at each
// point of choice, and its entry point runs the op's body under measured_routes():
//   - A case is (op, level, activations' dtype, class of M: 1, 2-3, 4-7, ..., N, K, an op-specific number such as
//     the group size, threads (1 inside another op's parallel region, where the kernel runs on its own thread),
//     whether torch's fp32 matmul precision allows bf16).
//   - The first call of a case runs the body by the rules while noting the sites it asks about. When a site had
//     two or more candidates (and no pin), each candidate runs once to warm up, then all of them R times in turn
//     (R = 5 below 2 ms a call, 3 below 20 ms, else 1), and the one with the smallest median is kept for the
//     process. The call returns the kept route's result, so every call of a case gives the same numbers.
//   - Only the first such site of a body is measured (no op asks about two in one call today); a case whose body
//     asked about no site is not stored and is looked at again on its next call (cheap: that call is the call).
//   - Routes are exact, not bit-identical: they sum the same products in other orders. Within a process every call
//     of a case gives the same bits; two processes may keep different routes for a close race and differ by float32
//     rounding. A route table loaded from a file (or the rules, or a pin) makes them agree.
//   - The cost is paid once per case: about 2R + 3 calls of it, e.g. 1.3 ms for a 4096 x 4096 int4 decode and
//     0.3 s for its 256-token prefill.
// TORCHQKIT_CPU_ROUTES=rules turns the measuring off (each site takes its rule); a site's own variable
// (TORCHQKIT_CPU_FP32_PREFILL=panels|sgemm, TORCHQKIT_CPU_INT4_DECODE=float|int16|bf16) pins its choice wherever that
// choice can serve, for reproducible benchmarks. torchqkit.kernels.routes() lists what was chosen with the
// measured times, status() shows it, and kernels.save_routes / load_routes keep the table on disk, keyed by the CPU
// model and the torch / torchqkit / extension versions (torchqkit/kernels/routes.py).
#include "route_choice.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fp32_matmul_precision.h"
#include "kernels.h"
#include "parallel.h"

namespace torchqkit_cpu {
namespace {

struct SiteInfo {
  const char* name;
  const char* env;  // the variable that pins the site's choice
  std::array<const char*, 3> choices;
  int count;
};

constexpr const char* kFp32PrefillPin = "TORCHQKIT_CPU_FP32_PREFILL";
constexpr const char* kInt4DecodePin = "TORCHQKIT_CPU_INT4_DECODE";

const SiteInfo kSites[kRouteSites] = {
    {"fp32_prefill", kFp32PrefillPin, {"panels", "sgemm", nullptr}, 2},
    {"int4_decode", kInt4DecodePin, {"float", "int16", "bf16"}, 3},
};

std::string choice_list(const SiteInfo& s) {
  std::string out;
  for (int c = 0; c < s.count; ++c) out += (c ? ", " : "") + std::string(s.choices[c]);
  return out;
}

// The choice the site's variable pins, -1 when it is unset.
int pinned(RouteSite site) {
  const SiteInfo& s = kSites[(int)site];
  const char* env = std::getenv(s.env);
  if (env == nullptr || *env == '\0') return -1;
  for (int c = 0; c < s.count; ++c)
    if (std::strcmp(env, s.choices[c]) == 0) return c;
  TORCH_CHECK(false, s.env, "=", env, " is not one of ", choice_list(s), "; unset it to let each case take the route "
              "measured fastest (kernels.routes() lists them)");
}

bool measuring() {
  const char* env = std::getenv("TORCHQKIT_CPU_ROUTES");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "measure") == 0) return true;
  TORCH_CHECK(std::strcmp(env, "rules") == 0, "TORCHQKIT_CPU_ROUTES=", env, " is not one of measure, rules");
  return false;
}

// The op call running under measured_routes on this thread: what it must take and what it asked about.
struct Probe {
  bool active = false;
  int forced[kRouteSites];
  unsigned asked[kRouteSites];
  int rule[kRouteSites];
  void reset() {
    for (int s = 0; s < kRouteSites; ++s) forced[s] = rule[s] = -1, asked[s] = 0;
  }
};
thread_local Probe probe;

struct ProbeScope {  // the probe is active for one op call, also when the body throws
  ProbeScope() { probe.reset(), probe.active = true; }
  ~ProbeScope() { probe.active = false; }
};

int m_class(int64_t m) { return m <= 1 ? 1 : 64 - __builtin_clzll((uint64_t)m); }  // bits of M: 2-3 -> 2, 4-7 -> 3

std::string m_range(int cls) {
  if (cls <= 1) return "1";
  return std::to_string(int64_t{1} << (cls - 1)) + "-" + std::to_string((int64_t{1} << cls) - 1);
}

struct Key {
  const char* op;  // compared as text: loaded keys point into interned names
  int isa, dtype, mcls;
  int64_t n, k, extra;
  int threads;
  bool bf16_precision;
  bool operator==(const Key& o) const {
    return isa == o.isa && dtype == o.dtype && mcls == o.mcls && n == o.n && k == o.k && extra == o.extra &&
           threads == o.threads && bf16_precision == o.bf16_precision && std::strcmp(op, o.op) == 0;
  }
  std::string text() const {  // the form kernels.save_routes writes and add_routes reads
    std::ostringstream s;
    s << op << '|' << isa << '|' << dtype << '|' << mcls << '|' << n << '|' << k << '|' << extra << '|' << threads
      << '|' << (bf16_precision ? 1 : 0);
    return s.str();
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = std::hash<std::string_view>()(key.op);
    for (int64_t v : {(int64_t)key.isa, (int64_t)key.dtype, (int64_t)key.mcls, key.n, key.k, key.extra,
                      (int64_t)key.threads, (int64_t)key.bf16_precision})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct Entry {
  int site = -1, choice = -1, rule = -1;
  unsigned candidates = 0;
  std::array<double, 3> median_us{};  // per choice, 0 where not a candidate
  bool loaded = false;                // from kernels.load_routes, not measured here
};

std::mutex table_mutex;
std::unordered_map<Key, Entry, KeyHash> table;
std::set<std::string> interned_ops;  // the op names of loaded keys; set nodes never move

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The first site the rules' run asked about with two or more candidates and no pin, or -1.
int site_to_measure() {
  for (int s = 0; s < kRouteSites; ++s)
    if (__builtin_popcount(probe.asked[s]) >= 2 && pinned((RouteSite)s) < 0) return s;
  return -1;
}

}  // namespace

int take_route(RouteSite site, unsigned candidates, int rule) {
  const int pin = pinned(site);
  if (pin >= 0 && (candidates & route_bit(pin))) return pin;
  if (!probe.active) return rule;
  const int s = (int)site;
  probe.asked[s] |= candidates;
  if (probe.rule[s] < 0) probe.rule[s] = rule;
  const int f = probe.forced[s];
  return f >= 0 && (candidates & route_bit(f)) ? f : rule;
}

at::Tensor measured_routes(const RouteCase& c, RouteBody body) {
  if (probe.active || !measuring()) return body();  // an op inside an op: its caller's probe decides
  // Inside another op's parallel region (a grouped op's experts side by side) the kernel runs on its one thread.
  const int threads = at::in_parallel_region() ? 1 : (int)at::get_num_threads();
  const Key key{c.op, c.isa, c.dtype, m_class(c.m), c.n, c.k, c.extra, threads,
                fp32_matmul_allows_bf16()};
  Entry found;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    auto it = table.find(key);
    if (it != table.end()) found = it->second;
  }
  ProbeScope scope;
  if (found.site >= 0) {
    probe.forced[found.site] = found.choice;
    return body();
  }
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  at::Tensor out = body();  // by the rules, noting the sites asked about
  const double rules_us = std::chrono::duration<double, std::micro>(clock::now() - t0).count();
  const int s = site_to_measure();
  if (s < 0) return out;
  Entry e;
  e.site = s;
  e.rule = probe.rule[s];
  e.candidates = probe.asked[s];
  std::vector<int> choices;
  for (int ch = 0; ch < kSites[s].count; ++ch)
    if (e.candidates & route_bit(ch)) choices.push_back(ch);
  const int rounds = rules_us < 2000 ? 5 : rules_us < 20000 ? 3 : 1;
  std::vector<std::vector<double>> us(choices.size());
  for (int ch : choices) probe.forced[s] = ch, (void)body();  // warm up: scratch, tables, caches
  int last = -1;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < choices.size(); ++i) {
      probe.forced[s] = choices[i];
      t0 = clock::now();
      out = body();
      us[i].push_back(std::chrono::duration<double, std::micro>(clock::now() - t0).count());
      last = choices[i];
    }
  size_t best = 0;
  for (size_t i = 0; i < choices.size(); ++i) {
    e.median_us[choices[i]] = median(us[i]);
    if (e.median_us[choices[i]] < e.median_us[choices[best]]) best = i;
  }
  e.choice = choices[best];
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    table[key] = e;
  }
  probe.forced[s] = e.choice;
  return last == e.choice ? out : body();
}

std::string routes_json() {
  std::lock_guard<std::mutex> lock(table_mutex);
  std::ostringstream o;
  o << '[';
  bool first = true;
  for (const auto& [key, e] : table) {
    const SiteInfo& site = kSites[e.site];
    o << (first ? "" : ", ") << "{\"key\": \"" << key.text() << "\", \"op\": \"" << key.op << "\", \"isa\": \""
      << isa_name((Isa)key.isa) << "\", \"dtype\": \"" << c10::toString((at::ScalarType)key.dtype)
      << "\", \"m\": \"" << m_range(key.mcls) << "\", \"n\": " << key.n << ", \"k\": " << key.k
      << ", \"extra\": " << key.extra << ", \"threads\": " << key.threads
      << ", \"bf16_precision\": " << (key.bf16_precision ? "true" : "false") << ", \"site\": \"" << site.name
      << "\", \"choice\": \"" << site.choices[e.choice] << "\", \"rule\": \""
      << (e.rule >= 0 ? site.choices[e.rule] : "") << "\", \"loaded\": " << (e.loaded ? "true" : "false")
      << ", \"median_us\": {";
    bool first_time = true;
    for (int ch = 0; ch < site.count; ++ch)
      if (e.candidates & route_bit(ch)) {
        o << (first_time ? "" : ", ") << '"' << site.choices[ch] << "\": " << e.median_us[ch];
        first_time = false;
      }
    o << "}}";
    first = false;
  }
  o << ']';
  return o.str();
}

void clear_routes() {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.clear();
}

int64_t add_routes(const std::string& lines) {
  std::istringstream in(lines);
  std::string line;
  int64_t added = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::string key_text, site_name, choice_name;
    TORCH_CHECK(std::getline(fields, key_text, '\t') && std::getline(fields, site_name, '\t') &&
                    std::getline(fields, choice_name, '\t'),
                "torchqkit_cpu::add_routes: a line must be key<TAB>site<TAB>choice, got '", line, "'");
    std::vector<std::string> parts;
    std::istringstream key_in(key_text);
    for (std::string part; std::getline(key_in, part, '|');) parts.push_back(part);
    TORCH_CHECK(parts.size() == 9, "torchqkit_cpu::add_routes: key '", key_text, "' does not have 9 fields");
    int s = -1, ch = -1;
    for (int i = 0; i < kRouteSites; ++i)
      if (site_name == kSites[i].name) s = i;
    TORCH_CHECK(s >= 0, "torchqkit_cpu::add_routes: unknown site '", site_name, "'");
    for (int i = 0; i < kSites[s].count; ++i)
      if (choice_name == kSites[s].choices[i]) ch = i;
    TORCH_CHECK(ch >= 0, "torchqkit_cpu::add_routes: '", choice_name, "' is not one of ", choice_list(kSites[s]));
    std::lock_guard<std::mutex> lock(table_mutex);
    const char* op = interned_ops.insert(parts[0]).first->c_str();
    const Key key{op, std::stoi(parts[1]), std::stoi(parts[2]), std::stoi(parts[3]), std::stoll(parts[4]),
                  std::stoll(parts[5]), std::stoll(parts[6]), std::stoi(parts[7]), parts[8] == "1"};
    Entry e;
    e.site = s;
    e.choice = ch;
    e.candidates = route_bit(ch);
    e.loaded = true;
    table[key] = e;
    ++added;
  }
  return added;
}

}  // namespace torchqkit_cpu
