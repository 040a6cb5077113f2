// The low-bit weight-only kernels written once over a vector-width traits struct `V` (simd.h): decoders, the
// dot kernel (decode, small M), the fp32 block decode and the dot-tile prefill.
//
// NO include guard on purpose: linear_lowbit.cpp includes this file once inside each ISA's
// `#pragma GCC target` region, in that ISA's namespace, after `using V = Vec512;` (or Vec256), so every
// function here is compiled for that ISA (a function template takes the target of the region it is defined
// in, not of its caller). A next ISA is one more region and one more traits struct, not a copy of this code.
//
// Note [Low-bit decode steps]: every format turns one step of kStep = 32 consecutive weights of a row
// (starting on a byte: 16 bytes of nf4 / fp4, 32 of float8, 4 * bits of intx) into W = 32 / L vectors of fp32
// levels in k order (the dot kernel takes nf4 / fp4, and on AVX2 packed intx, in a cheaper "dot order" with x
// permuted to match: Lut4, PlaneLut4, LaneIntx; a decoder with kPermuted says so and gives k_of).
// Rows start on a byte in every layout, so step c of a row starts at byte c * kBytes.
// A step whose reads (kRead bytes, which may pass the step's own bytes) would leave the row is copied into a
// zeroed stack buffer first; the glue pads x with zero columns up to a multiple of 32, so the lanes past K
// add nothing.
//
// Note [Group scales once per group]: levels are multiplied by their group's scale once per group, not per
// weight: with one token (kGroup) sum_k x * level runs over the group in its own accumulator, which then
// goes into the row's accumulator times the scale (one FMA per group); with one scale per row (kRow, e.g.
// float8 per row, or decoded fp32 blocks) the product happens once, after the row; with several tokens
// (kScaled) the decoded levels are scaled once and shared by the tokens' FMAs. Offsets (intx zero
// points) never touch a weight: sum_k x * o(group) = o(group) * (sum of x over the group), those sums
// computed once per call (xsum) and combined with a row's offsets after its dot product.

constexpr int kStep = 32;
constexpr int W = kStep / V::L;  // vectors per step
using F = V::F;

// ================================================================ decoders: one step -> W vectors (k order)

// Where a decoder's dot order puts a step's two groups of 16 (Note [Groups of half a step]): not usable for them
// (kKOrder: the groups take the k-order decode, whose vectors t < W / 2 hold the first), in vectors t < W / 2 and
// the rest (kVectorHalves), or in lanes j < L / 2 and the rest of every vector (kLaneHalves).
enum class G16 { kKOrder, kVectorHalves, kLaneHalves };

// 4-bit codes through a 16-entry table: nf4 (element 2j = byte j's high nibble) and fp4 e2m1 (low nibble).
// In k order (decode_rows) the nibbles are interleaved in bytes (one unpack) before the lookups. The dot kernel
// takes them in "dot order" instead, which skips the masks and unpacks: vector t < W / 2 holds the low
// nibbles of bytes [t L, t L + L), vector W / 2 + t their high nibbles (the lookup reads a lane's low 4 bits
// only), and x is permuted once per call to match (k_of).
template <bool kHighFirst>
struct Lut4 {
  static constexpr int kBytes = 16, kRead = 16;
  static constexpr bool kPermuted = true;
  // With 16 lanes, lanes j < 8 of both dot-order vectors hold k < 16: Note [Groups of half a step].
  static constexpr G16 kG16 = V::L == 16 ? G16::kLaneHalves : G16::kKOrder;
  static int64_t row_bytes(const LowbitArgs& p) { return p.K / 2; }
  static int k_of(int t, int j) {  // the k (within a step) of lane j of dot-order vector t
    const bool high = t >= W / 2;
    return 2 * ((t % (W / 2)) * V::L + j) + (high == kHighFirst ? 0 : 1);
  }
  V::Lut16 lut;
  explicit Lut4(const float* table) : lut(V::lut16(table)) {}
  template <int T = 0>
  void levels16(__m128i codes, F* w) const {
    w[T] = V::lookup(lut, V::u8_to_i32<T>(codes));
    if constexpr (T + 1 < 16 / V::L) levels16<T + 1>(codes, w);
  }
  void operator()(const uint8_t* b, F (&w)[W]) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    levels16(kHighFirst ? _mm_unpacklo_epi8(hi, lo) : _mm_unpacklo_epi8(lo, hi), w);
    levels16(kHighFirst ? _mm_unpackhi_epi8(hi, lo) : _mm_unpackhi_epi8(lo, hi), w + W / 2);
  }
  // Each byte zero-extended once; its high nibble is that lane >> 4 (no second widening: one shuffle less per
  // 16 codes than widening the shifted bytes).
  template <int T = 0>
  void low_high(__m128i codes, F (&w)[W]) const {
    const V::I z = V::template u8_to_i32<T>(codes);
    w[T] = V::lookup(lut, z);
    w[W / 2 + T] = V::lookup(lut, V::template srli_i<4>(z));
    if constexpr (T + 1 < 16 / V::L) low_high<T + 1>(codes, w);
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const {
    low_high(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), w);
  }
};
struct Nf4 : Lut4<true> { explicit Nf4(const LowbitArgs&) : Lut4(kNf4) {} };
struct Fp4 : Lut4<false> { explicit Fp4(const LowbitArgs&) : Lut4(kFp4) {} };

// Note [AVX2 4-bit lookups by byte planes]: vpermps has 8 entries on AVX2, so Lut4's lookup of 8 codes costs two
// permutes and a blend (plus a shift for the blend's mask and the widening of the bytes): about 2.3 cycles per 8
// weights on Zen 4, the whole budget of a memory-speed decode. vpshufb looks up 32 bytes at once in a 16-entry
// byte table, so the 16 levels are kept as kPlanes byte planes (plane q: byte 4 - kPlanes + q of each level's
// fp32 bits) and a step of 32 codes is looked up with kPlanes vpshufb, then its bytes are interleaved into fp32
// lanes with unpacks (plane pairs into 16-bit words, then words into dwords). fp4 e2m1 levels have at most two
// significant bits, so their low 16 bits are zero: two planes, and the words go into the dwords' high halves.
// Measured in isolation (benchmarks/bench_lowbit_avx2_loops.cpp: 4 rows x 1024 codes in L1, 8 accumulators): nf4
// 2.27 -> 1.57, fp4 -> 1.21 cycles per 8 weights. The dot order differs from Lut4's (k_of below); the k-order decode (operator()) is Lut4's.
// A template over the traits Vt (= V) only so that the AVX-512 regions, which never use it, don't compile it.
template <class Vt, bool kHighFirst, int kPlanes>
struct PlaneLut4 : Lut4<kHighFirst> {
  static_assert(Vt::L == 8 && (kPlanes == 2 || kPlanes == 4), "byte planes fill AVX2's 8 fp32 lanes");
  static constexpr G16 kG16 = G16::kVectorHalves;  // vector t holds k in [8 t, 8 t + 8)
  // The 32 codes of a step sit in one ymm as bytes: 128-bit lane 0 = the low nibbles of bytes 0..15, lane 1 their
  // high nibbles. Dot-order vector t, lane j: nibble byte 4 t + j % 4 of 128-bit lane j / 4.
  static int k_of(int t, int j) {
    const bool high = j >= 4;
    return 2 * (4 * t + j % 4) + (high == kHighFirst ? 0 : 1);
  }
  __m256i plane[kPlanes];
  explicit PlaneLut4(const float* table) : Lut4<kHighFirst>(table) {
    alignas(16) uint8_t bytes[kPlanes][16];
    for (int c = 0; c < 16; ++c) {
      uint32_t bits;
      std::memcpy(&bits, table + c, 4);
      for (int q = 0; q < kPlanes; ++q) bytes[q][c] = static_cast<uint8_t>(bits >> (8 * (4 - kPlanes + q)));
    }
    for (int q = 0; q < kPlanes; ++q)
      plane[q] = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes[q])));
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                       _mm256_set1_epi8(0x0F));
    __m256i lo, hi;  // 16-bit words of bytes 0..7 / 8..15 of each 128-bit lane: the levels' high halves...
    const __m256i p2 = _mm256_shuffle_epi8(plane[kPlanes - 2], n), p3 = _mm256_shuffle_epi8(plane[kPlanes - 1], n);
    const __m256i hw_lo = _mm256_unpacklo_epi8(p2, p3), hw_hi = _mm256_unpackhi_epi8(p2, p3);
    if constexpr (kPlanes == 4) {  // ... and low halves
      const __m256i p0 = _mm256_shuffle_epi8(plane[0], n), p1 = _mm256_shuffle_epi8(plane[1], n);
      lo = _mm256_unpacklo_epi8(p0, p1);
      hi = _mm256_unpackhi_epi8(p0, p1);
    } else {
      lo = hi = _mm256_setzero_si256();
    }
    w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(lo, hw_lo));
    w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(lo, hw_lo));
    w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(hi, hw_hi));
    w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(hi, hw_hi));
  }
};
template <class Vt>
struct PlaneNf4 : PlaneLut4<Vt, true, 4> { explicit PlaneNf4(const LowbitArgs&) : PlaneLut4<Vt, true, 4>(kNf4) {} };
template <class Vt>
struct PlaneFp4 : PlaneLut4<Vt, false, 2> { explicit PlaneFp4(const LowbitArgs&) : PlaneLut4<Vt, false, 2>(kFp4) {} };
// Packed int4 (low nibble first, like fp4): its levels u + code_offset are small integers, exact in bf16, so the
// same two planes serve it; a row of odd K ends in a half-used byte.
template <class Vt>
struct PlaneInt4 : PlaneLut4<Vt, false, 2> {
  static int64_t row_bytes(const LowbitArgs& p) { return (p.K + 1) / 2; }
  static std::array<float, 16> levels(const LowbitArgs& p) {
    std::array<float, 16> l;
    for (int u = 0; u < 16; ++u) l[u] = static_cast<float>(u + p.code_offset);
    return l;
  }
  explicit PlaneInt4(const LowbitArgs& p) : PlaneLut4<Vt, false, 2>(levels(p).data()) {}
};

// float8 through fp16 (vcvtph2ps converts exactly). e5m2 is the high byte of an fp16. e4m3fn:
// (byte << 8) >> 1 (arithmetic) is s s eeee mmm 0000000; clearing bit 14 leaves the fp16 with sign s,
// exponent 0eeee and mantissa mmm0000000, whose value is the e4m3 value / 256 (subnormals included; the glue
// folds 256 into the scale). eeee mmm = 1111 111 is NaN: a step holding one (never in weights quantized from
// finite values, but the format allows it) takes a slower decode that sets those fp16 exponents to all ones.
// Note [float8 fnuz bytes]: AMD's fnuz formats (Note [float8 fnuz] in torchqkit/core/qdtype.py) have one exponent
// bias more, so a byte's value is half the OCP value of the same bits, and no inf: 0x80 is their only NaN.
// e4m3fnuz takes e4m3fn's decode (its 0x7F / 0xFF, e4m3fn's NaN codes, come out as 480 / 256: +-240 times 128) with
// 128 folded into the scale, and checks for 0x80 instead. e5m2fnuz can't be an fp16's high byte (its exponent 31 is
// finite: up to 57344): the fp16 of its value is built from the magnitude m = eeeee mm, exactly: for e >= 2 the
// fp16 exponent is e - 1, bits (m << 8) - 0x400; for e <= 1 the value is an fp16 subnormal (1.mm * 2^-15 =
// 0.1mm * 2^-14, and 0.mm * 2^-15), bits m << 7; the larger of the two (signed 16-bit) is the right one in every
// case, so one vpmaxsw picks it.
enum class F8Kind { kE4m3fn, kE5m2, kE4m3fnuz, kE5m2fnuz };

template <F8Kind kKind>
struct F8 {
  static constexpr bool kE4m3 = kKind == F8Kind::kE4m3fn || kKind == F8Kind::kE4m3fnuz;
  static constexpr bool kFnuz = kKind == F8Kind::kE4m3fnuz || kKind == F8Kind::kE5m2fnuz;
  // Codes whose unchecked decode is finite but whose value is NaN (e5m2's NaN and inf come out of the fp16
  // conversion as they are).
  static constexpr bool kNanCodes = kKind != F8Kind::kE5m2;
  static constexpr int kBytes = 32, kRead = 32;
  static constexpr bool kPermuted = false;
  static int64_t row_bytes(const LowbitArgs& p) { return p.K; }
  explicit F8(const LowbitArgs&) {}
  // 32 bytes -> bytes that are 0x7F exactly at the NaN codes and below it elsewhere (NanTrack keeps their max).
  static __m256i nan_lanes(__m256i v) {
    if constexpr (kFnuz) return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(static_cast<char>(0x80))),
                                                  _mm256_set1_epi8(0x7F));
    else return _mm256_and_si256(v, _mm256_set1_epi8(0x7F));
  }
  static bool has_nan(const uint8_t* b) {
    const __m256i l = nan_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(l, _mm256_set1_epi8(0x7F))) != 0;
  }
  void operator()(const uint8_t* b, F (&w)[W]) const {
    if (kNanCodes && has_nan(b)) return vectors<0, true>(b, w);
    unchecked(b, w);
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const { (*this)(b, w); }
  // The decode without the NaN-code check (a NaN code decodes to a finite value): Note [NaN codes off the hot loop].
  void unchecked(const uint8_t* b, F (&w)[W]) const {
    if constexpr (V::L == 8 && kE4m3) wide(b, w);
    else vectors<0, false>(b, w);
  }
  // AVX2 e4m3: the step's 32 bytes widened to fp16 bits with two 256-bit unpacks (bytes 0..7 | 16..23 and 8..15 |
  // 24..31 as byte << 8) instead of four 128-bit ones, so the shift and mask run on 16 codes per instruction:
  // 2.4 -> 1.74 cycles per 8 weights on Zen 4 (benchmarks/bench_lowbit_avx2_loops.cpp). The vectors stay in k order. (e5m2 has no shift
  // or mask to share, and the two lane extracts made it 0.94x: it keeps the 128-bit unpacks.)
  void wide(const uint8_t* b, F (&w)[W]) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), z = _mm256_setzero_si256();
    const __m256i m = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
    const __m256i lo = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(z, v), 1), m);
    const __m256i hi = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(z, v), 1), m);
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
    w[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
    w[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
    w[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
  }
  template <int T, bool kNan>
  void vectors(const uint8_t* b, F (&w)[W]) const {
    if constexpr (kE4m3 && !kNan && V::L == 16) {
      // The same fp16 bits: the sign-extended byte << 7 is s s eeee mmm 0000000 (AVX-512: one op less than
      // hi16's zero-extend + shift; on AVX2 hi16 is one unpack, so the general form is as cheap there).
      w[T] = V::half_to_f(V::and_h(V::slli7_h(V::sx16<T>(b)), V::set1_h(static_cast<int16_t>(0xBFFF))));
    } else if constexpr (kE4m3) {
      const V::H u = V::hi16<T>(b);
      V::H h = V::and_h(V::srai1_h(u), V::set1_h(static_cast<int16_t>(0xBFFF)));
      if constexpr (kNan && kFnuz) {  // 0x80 decoded to -0 (0x8000): an fp16 NaN instead
        h = V::or_h(h, V::and_h(V::cmpeq_h(u, V::set1_h(static_cast<int16_t>(0x8000))), V::set1_h(0x7E00)));
      } else if constexpr (kNan) {
        const V::H em = V::and_h(u, V::set1_h(0x7F00));
        h = V::or_h(h, V::and_h(V::cmpeq_h(em, V::set1_h(0x7F00)), V::set1_h(0x7C00)));
      }
      w[T] = V::half_to_f(h);
    } else if constexpr (kFnuz) {  // e5m2fnuz: Note [float8 fnuz bytes]
      const V::H u = V::hi16<T>(b), m8 = V::and_h(u, V::set1_h(0x7F00));
      V::H h = V::or_h(V::max_h(V::sub_h(m8, V::set1_h(0x400)), V::srli1_h(m8)),
                       V::and_h(u, V::set1_h(static_cast<int16_t>(0x8000))));
      if constexpr (kNan)
        h = V::or_h(h, V::and_h(V::cmpeq_h(u, V::set1_h(static_cast<int16_t>(0x8000))), V::set1_h(0x7E00)));
      w[T] = V::half_to_f(h);
    } else {
      w[T] = V::half_to_f(V::hi16<T>(b));
    }
    if constexpr (T + 1 < W) vectors<T + 1, kNan>(b, w);
  }
};

// 16 fields of B bits = 2 B bytes (<= 14) per half step, broadcast to every 128-bit lane: lane j of vector t
// takes the two bytes holding field i = t L + j (pshufb), shifts right by (i B) % 8; then level = (B low bits)
// + code_offset (the glue's qmin). When 2^B levels fit the one-instruction table (V::kPermEntries), the table
// (field + code_offset, repeated) does mask, offset and conversion at once; else in integers, then converted.
template <int B>
struct Intx {
  static constexpr int kBytes = 4 * B, kRead = 2 * B + 16;
  static constexpr bool kPermuted = false, kTable = (1 << B) <= V::kPermEntries;
  static int64_t row_bytes(const LowbitArgs& p) { return (p.K * B + 7) / 8; }
  V::I ctrl[16 / V::L], shifts[16 / V::L], mask, neg_offset;
  F table;
  explicit Intx(const LowbitArgs& p) : mask(V::set1_i((1 << B) - 1)), neg_offset(V::set1_i(-p.code_offset)) {
    alignas(64) float levels[V::L];
    for (int j = 0; j < V::L; ++j) levels[j] = static_cast<float>(j % (1 << B) + p.code_offset);
    table = V::loadu(levels);
    for (int t = 0; t < 16 / V::L; ++t) {
      alignas(64) int8_t c[4 * V::L];
      alignas(64) int32_t s[V::L];
      for (int j = 0; j < V::L; ++j) {
        const int bit = (t * V::L + j) * B;
        c[4 * j] = static_cast<int8_t>(bit / 8);
        c[4 * j + 1] = static_cast<int8_t>(bit / 8 + 1);  // <= 14: inside the 16 loaded bytes
        c[4 * j + 2] = c[4 * j + 3] = static_cast<int8_t>(0x80);
        s[j] = bit % 8;
      }
      ctrl[t] = V::load_i(c);
      shifts[t] = V::load_i(s);
    }
  }
  void half(const uint8_t* b, F* w) const {
    const V::I d = V::broadcast128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    for (int t = 0; t < 16 / V::L; ++t) {
      const V::I f = V::srlv(V::shuffle_bytes(d, ctrl[t]), shifts[t]);
      if constexpr (kTable) w[t] = V::perm(table, f);
      else w[t] = V::cvt(V::sub_i(V::and_i(f, mask), neg_offset));
    }
  }
  void operator()(const uint8_t* b, F (&w)[W]) const {
    half(b, w);
    half(b + 2 * B, w + W / 2);
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const { (*this)(b, w); }
};

// Note [intx fields by lanes of whole codes]: Intx cuts every code out with its own pshufb + vpsrlvd (the two bytes
// that hold it, moved into its lane), three shuffle / shift ops per L codes before the table lookup. B = 1, 2, 3, 4, 6
// pack whole codes into R = 4 (B = 1, 2, 4) or 3 (B = 3, 6) bytes, so one pshufb puts R bytes (C = 8 R / B codes)
// into each dword lane and one vpsrlvd pre-shifts the lanes that repeat a group; vector t of the step is then that
// dword >> (B t), looked up (2^B levels within the one-instruction table) or masked and converted: per L codes one
// immediate shift and the lookup, plus one pshufb and one vpsrlvd per 32. Lane j holds group g = j % N (N = 32 / C
// groups of R bytes per step) shifted by (j / N) W B bits (W = 32 / L vectors per step), so vector t, lane j is code
// g C + (j / N) W + t of the step: the dot order (k_of) x is permuted to. B = 6 steps are 24 bytes: each 128-bit lane
// reads its own 12 (groups 0-3 or 4-7). B = 5, 7 keep Intx's decode. Measured in isolation for int3 on AVX2
// (benchmarks/bench_lowbit_avx2_loops.cpp, 4 rows x 1024 codes in L1): 1.83 -> 1.35 cycles per 8 weights on Zen 4;
// with AVX-512 (W = 2) a step takes 6 instructions instead of 10.
template <class Vt, int B>
struct LaneIntx : Intx<B> {
  static_assert(24 % B == 0 && B != 8, "whole codes in 3 or 4 bytes");
  static constexpr int kR = B % 3 == 0 ? 3 : 4, kC = 8 * kR / B, kN = 32 / kC;
  static constexpr int kRead = B == 6 ? 28 : 16;
  static constexpr bool kPermuted = true;
  static int k_of(int t, int j) { return (j % kN) * kC + (j / kN) * W + t; }
  typename Vt::I lane_ctrl, pre_shift;
  explicit LaneIntx(const LowbitArgs& p) : Intx<B>(p) {
    alignas(64) int8_t c[4 * Vt::L];
    alignas(64) int32_t sh[Vt::L];
    for (int j = 0; j < Vt::L; ++j) {
      const int g = j % kN, first = (B == 6 ? g % 4 : g) * kR;  // B = 6: groups 4..7 in the odd 128-bit lanes
      for (int q = 0; q < 4; ++q) c[4 * j + q] = static_cast<int8_t>(q < kR ? first + q : 0x80);
      sh[j] = (j / kN) * W * B;
    }
    lane_ctrl = Vt::load_i(c);
    pre_shift = Vt::load_i(sh);
  }
  // The step's bytes in every 128-bit lane (B = 6: bytes 0..15 in the even lanes, 12..27 in the odd ones).
  static typename Vt::I step_bytes(const uint8_t* b) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    if constexpr (B != 6) return Vt::broadcast128(lo);
    const __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 12)), 1);
    if constexpr (Vt::L == 8) return two;
    else return _mm512_broadcast_i64x4(two);
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const {
    const typename Vt::I d = Vt::srlv(Vt::shuffle_bytes(step_bytes(b), lane_ctrl), pre_shift);
#pragma GCC unroll 4
    for (int t = 0; t < W; ++t) {
      typename Vt::I f;
      if constexpr (Vt::L == 8) f = _mm256_srli_epi32(d, B * t);
      else f = _mm512_srli_epi32(d, B * t);
      if constexpr (Intx<B>::kTable) w[t] = Vt::perm(this->table, f);
      else w[t] = Vt::cvt(Vt::sub_i(Vt::and_i(f, this->mask), this->neg_offset));
    }
  }
};

// Decoded fp32 weights (the prefill's L2 blocks): rows are whole steps, so no step is ever a tail.
struct F32 {
  static constexpr int kBytes = 4 * kStep, kRead = kBytes;
  static constexpr bool kPermuted = false;
  static int64_t row_bytes(const LowbitArgs& p) { return (p.K + kStep - 1) / kStep * kBytes; }
  F32() = default;
  explicit F32(const LowbitArgs&) {}
  void operator()(const uint8_t* b, F (&w)[W]) const {
    for (int t = 0; t < W; ++t) w[t] = V::loadu(reinterpret_cast<const float*>(b) + t * V::L);
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const { (*this)(b, w); }
};

// Note [FP6 through fp16]: an FP6 code s eee mm (e3m2) / s ee mmm (e2m3) is read as the fp16 with sign s, exponent
// 00eee / 000ee and mantissa mm00000000 / mmm0000000: the same fields shifted into place, whose value is the FP6 value
// times 2^(bias - 15) (2^-12 for e3m2, 2^-14 for e2m3), subnormals included (vcvtph2ps converts fp16 subnormals
// exactly, and no fp32 subnormal is formed, so denormals-are-zero modes can't touch it). The AVX2 decoder (AVX-512's:
// Note [FP6 codes to bf16 by vpermi2w]) cuts the fields in 16-bit lanes, 16 codes (12 bytes) per ymm: pshufb puts
// the two bytes holding code u into word u (both 128-bit lanes read the same 16 bytes), a vpmullw by 2^(10 - s) (s:
// the code's bit offset in its word; AVX2 has no per-word shift) moves the code to bits 10..15, its sign already
// fp16's, and an arithmetic shift by the mantissa width and one mask leave the fp16 bits; vcvtph2ps widens each
// 128-bit half (k order, no permutation). Times 2^12 / 2^14 per vector these are the FP6 values themselves (the
// fp32 blocks of the prefill); the dot kernel takes the fp16 values as they are (Raw) and multiplies x by 2^12 / 2^14
// once per call instead, the same products (powers of two: exact) unless some |x| exceeds 2^115, which takes the
// multiply per vector. (Not folded into scale_mul like float8's 256: e3m2's largest value is 28, so a weight near
// float32's maximum has a scale near 2^123, and 2^12 more overflows.) 4096 x 4096 e2m3 per row, M = 1, one Zen 5
// core, weights cached: 3.09 ms through the packed intx fields and an fp32 -> fp16 bit conversion, 1.18 ms cut in
// 16-bit lanes, 1.01 ms with x scaled.
template <class Vt, int kMant, bool kUnit = true>
struct Fp6Fp16 {
  static_assert(Vt::L == 8, "16-bit lanes of one ymm: AVX2");
  using Raw = Fp6Fp16<Vt, kMant, false>;  // the fp16 values themselves (the dot kernel, with x times kRawScale)
  static constexpr float kRawScale = kMant == 2 ? 0x1p12f : 0x1p14f;
  static constexpr int kBytes = 24, kRead = 28;
  static constexpr bool kPermuted = false;
  static int64_t row_bytes(const LowbitArgs& p) { return (p.K * 6 + 7) / 8; }
  __m256i ctrl, mult;
  explicit Fp6Fp16(const LowbitArgs&) {
    alignas(32) int8_t c[32];
    alignas(32) int16_t m[16];
    for (int u = 0; u < 16; ++u) {
      c[2 * u] = static_cast<int8_t>(6 * u / 8);
      c[2 * u + 1] = static_cast<int8_t>(6 * u / 8 + 1);  // <= 12: inside the 16 loaded bytes
      m[u] = static_cast<int16_t>(1 << (10 - 6 * u % 8));
    }
    ctrl = _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
    mult = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
  }
  void half(const uint8_t* b, F* w) const {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256i top = _mm256_mullo_epi16(_mm256_shuffle_epi8(v, ctrl), mult);
    const __m256i h = _mm256_and_si256(_mm256_srai_epi16(top, kMant),
                                       _mm256_set1_epi16(static_cast<int16_t>(0x8000 | 31 << (10 - kMant))));
    const F f = Vt::set1(kRawScale);
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    w[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    if constexpr (kUnit) w[0] = Vt::mul(w[0], f), w[1] = Vt::mul(w[1], f);
  }
  void operator()(const uint8_t* b, F (&w)[W]) const {
    half(b, w);
    half(b + 12, w + 2);
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const { (*this)(b, w); }
};

// Note [FP6 codes to bf16 by vpermi2w]: every FP6 value has at most 4 significant bits, so it is exact in bf16, and
// AVX-512 BW's vpermi2w looks up 32 words in a table of 64 (two zmm): the 6-bit code (sign included, the index's
// higher bits ignored) -> its value's bf16 bits, which are the high half of its fp32 bits. A step's 32 codes go into
// 16-bit lanes: 128-bit lane q holds codes 8q .. 8q + 7 (bytes 6q .. 6q + 5: lanes 0, 1 read bytes 0..15, lanes 2, 3
// bytes 12..27), pshufb puts each code's two bytes into its word and vpsrlvw shifts it down; then the table, and
// vpunpcklwd / vpunpckhwd with zero make the fp32 lanes (dot order: vector t, lane j is code 8 (j / 4) + 4 t + j % 4).
// Per 32 weights: two loads (one a masked broadcast), pshufb, vpsrlvw, vpermi2w, two unpacks; k order (operator())
// widens the words with vpmovzxwd instead. 4096 x 4096 e2m3 per row, M = 1, one Zen 5 core, weights cached: 1.82 ms
// through the packed intx fields and an fp32 -> fp16 bit conversion with a multiply, 0.44 ms.
template <class Vt, int kMant>
struct Fp6Words {
  static_assert(Vt::L == 16, "32 words per zmm: AVX-512 BW");
  static constexpr int kBytes = 24, kRead = 28;
  static constexpr bool kPermuted = true;
  static int64_t row_bytes(const LowbitArgs& p) { return (p.K * 6 + 7) / 8; }
  static int k_of(int t, int j) { return 8 * (j / 4) + 4 * t + j % 4; }
  __m512i lo, hi, ctrl, shifts;
  explicit Fp6Words(const LowbitArgs&) {
    alignas(64) uint16_t table[64], s[32];
    alignas(64) int8_t c[64];
    for (int f = 0; f < 64; ++f) {
      const float v = scalar::fp6(f, kMant);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      table[f] = static_cast<uint16_t>(bits >> 16);  // the low half is zero: at most 4 significant bits
    }
    for (int u = 0; u < 32; ++u) {
      const int q = u / 8, first = 6 * u / 8 - (q < 2 ? 0 : 12);  // lanes 2, 3 read from byte 12
      c[2 * u] = static_cast<int8_t>(first);
      c[2 * u + 1] = static_cast<int8_t>(first + 1);  // <= 12: inside the lane's 16 bytes
      s[u] = static_cast<uint16_t>(6 * u % 8);
    }
    lo = _mm512_load_si512(table);
    hi = _mm512_load_si512(table + 32);
    ctrl = _mm512_load_si512(c);
    shifts = _mm512_load_si512(s);
  }
  // The step's 32 codes' bf16 values, word u = code u.
  __m512i words(const uint8_t* b) const {
    const __m512i first = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 12));
    const __m512i v = _mm512_mask_broadcast_i32x4(first, 0xFF00, second);
    return _mm512_permutex2var_epi16(lo, _mm512_srlv_epi16(_mm512_shuffle_epi8(v, ctrl), shifts), hi);
  }
  void dot_order(const uint8_t* b, F (&w)[W]) const {
    const __m512i h = words(b), z = _mm512_setzero_si512();
    w[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h));
    w[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h));
  }
  void operator()(const uint8_t* b, F (&w)[W]) const {
    const __m512i h = words(b);
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    w[1] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  }
};

// This level's decoders, for by_format.
struct Decoders {
  using nf4 = std::conditional_t<V::L == 8, PlaneNf4<V>, Nf4>;  // Note [AVX2 4-bit lookups by byte planes]
  using fp4 = std::conditional_t<V::L == 8, PlaneFp4<V>, Fp4>;
  using e4m3 = F8<F8Kind::kE4m3fn>;
  using e5m2 = F8<F8Kind::kE5m2>;
  using e4m3fnuz = F8<F8Kind::kE4m3fnuz>;
  using e5m2fnuz = F8<F8Kind::kE5m2fnuz>;
  template <int B>  // Note [intx fields by lanes of whole codes] (the bf16 glue permutes x: lowbit_bf16_dot_order)
  using intx = std::conditional_t<V::L == 8 && B == 4, PlaneInt4<V>,
                                  std::conditional_t<24 % B == 0 && B != 8, LaneIntx<V, B>, Intx<B>>>;
  // Note [FP6 codes to bf16 by vpermi2w], Note [FP6 through fp16]
  using fp6_e3m2 = std::conditional_t<V::L == 16, Fp6Words<V, 2>, Fp6Fp16<V, 2>>;
  using fp6_e2m3 = std::conditional_t<V::L == 16, Fp6Words<V, 3>, Fp6Fp16<V, 3>>;
};

// Step c of a row: a pointer into the row, or (when its reads would leave the row) a zero-padded copy in tmp.
template <class D>
inline const uint8_t* step_ptr(const uint8_t* row, int64_t c, int64_t rb, uint8_t (&tmp)[32]) {
  static_assert(D::kRead <= 32 || D::kRead == D::kBytes, "a tail copy must hold the step's reads");
  const int64_t b0 = c * D::kBytes;
  if (b0 + D::kRead <= rb) return row + b0;
  std::memset(tmp, 0, sizeof(tmp));
  std::memcpy(tmp, row + b0, rb - b0);
  return tmp;
}

// Steps of a row whose reads stay inside it (the rest go through step_ptr's copy).
template <class D>
inline int64_t full_steps(int64_t rb, int64_t nst) {
  return rb < D::kRead ? 0 : std::min(nst, (rb - D::kRead) / D::kBytes + 1);
}

// ================================================================ dot kernel (decode, small M)
constexpr int kRows = 4;  // weight rows per block (scales decoded once per block, then one or two tiles)
constexpr int kMaxMB = 4;  // tokens per tile
// Rows per tile of MB tokens: the MB x NB accumulators fit the registers (32 zmm; 16 ymm: 2 x 4 or 4 x 2).
template <int MB> constexpr int kNB = V::L == 16 || MB <= 2 ? 4 : 2;
constexpr int64_t kPfBytes = 4096;             // Note [decode prefetch] in int4_tiled_dot.inc

enum class Acc { kRow, kGroup, kScaled };  // Note [Group scales once per group]; kScaled: several tokens


// e4m3fn has NaN codes (eeee mmm = 1111 111), the fnuz formats one (0x80); e5m2's decode through fp16 already
// yields its NaN / inf.
template <class D> constexpr bool kNanCodes = false;
template <F8Kind K> constexpr bool kNanCodes<F8<K>> = F8<K>::kNanCodes;

// Note [NaN codes off the hot loop]: the dot loop decodes e4m3 (and the fnuz formats) without looking for NaN codes
// (a NaN code then decodes to a finite value) and keeps one running byte max over the tile's steps of the bytes
// D::nan_lanes makes (e4m3fn: byte & 0x7F, one `vpand` + `vpmaxub` per 32 weights; fnuz: 0x7F where the byte is
// 0x80, a `vpcmpeqb` more) (the per-step compare, movemask and branch cost a third of the float8 decode). A tile that
// held a NaN code (never in weights quantized from finite values) runs again with the checked decoder (kChecked),
// so the result is the reference's NaN.
struct NanTrack {
  __m256i max;
  NanTrack() : max(_mm256_setzero_si256()) {}  // written out: an implicit constructor lacks the ISA's target
  template <class D>
  __attribute__((always_inline)) void add(const uint8_t* b) {
    max = _mm256_max_epu8(max, D::nan_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
  }
  bool seen() const { return _mm256_movemask_epi8(_mm256_cmpeq_epi8(max, _mm256_set1_epi8(0x7F))) != 0; }
};

// One step of NB rows x MB tokens: row i's bytes at src[i] + off. A function, not a lambda: Note [accumulators in
// registers] in kernels.h.
template <class D, int MB, int NB, Acc A, bool kChecked>
__attribute__((always_inline)) inline void dot_step(F (&acc)[MB][NB], const D& dec, const uint8_t* const (&src)[NB],
                                                    int64_t off, const float* const (&xr)[MB], const F (&sv)[NB],
                                                    int64_t c, NanTrack& nan) {
#pragma GCC unroll 4
  for (int i = 0; i < NB; ++i) {
    F w[W];
    if constexpr (kNanCodes<D> && !kChecked) {
      dec.unchecked(src[i] + off, w);
      nan.template add<D>(src[i] + off);
    } else {
      dec.dot_order(src[i] + off, w);
    }
    if constexpr (A == Acc::kScaled)
      for (int t = 0; t < W; ++t) w[t] = V::mul(w[t], sv[i]);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
      for (int t = 0; t < W; ++t) acc[m][i] = V::fmadd(V::loadu(xr[m] + kStep * c + V::L * t), w[t], acc[m][i]);
  }
}

// Sums of x over each group, per token: xsum[m * G + g] (the offsets' side of Note [Group scales once per group]).
inline std::vector<float> group_sums(const LowbitArgs& p) {
  std::vector<float> xsum(p.offset ? p.M * p.G : 0);
  for (int64_t m = 0; m < (p.offset ? p.M : 0); ++m)
    for (int64_t g = 0; g < p.G; ++g) {
      const float* x = p.x + m * p.ldx + g * p.g;
      float s = 0.f;
      for (int64_t k = 0; k < p.g; ++k) s += x[k];
      xsum[m * p.G + g] = s;
    }
  return xsum;
}

// sum_g offset[base + g] * xs[g]
inline float offset_dot(const float* off, const float* xs, int64_t G) {
  F v = V::zero();
  int64_t g = 0;
  for (; g + V::L <= G; g += V::L) v = V::fmadd(V::loadu(off + g), V::loadu(xs + g), v);
  float s = V::reduce(v);
  for (; g < G; ++g) s += off[g] * xs[g];
  return s;
}

// Steps [c0, c1) of one group (or row) of NB weight rows: step(src, c) gets each row's bytes of step c; steps past
// nfull read through step_ptr's zero-padded copy. The fp32 and the bf16 dot loops both walk rows this way.
template <class D, int NB, class Step>
__attribute__((always_inline)) inline void walk_steps(const uint8_t* const (&wr)[NB], uint8_t (&tmp)[NB][32],
                                                      int64_t c0, int64_t c1, int64_t nfull, int64_t rb,
                                                      const Step& step) {
  int64_t c = c0;
  for (const int64_t cf = std::min(c1, nfull); c < cf; ++c) {
    if (((c * D::kBytes) & 63) < D::kBytes)  // a new cache line: Note [decode prefetch] in int4_tiled_dot.inc
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + c * D::kBytes + kPfBytes), _MM_HINT_T1);
    const uint8_t* src[NB];
    for (int i = 0; i < NB; ++i) src[i] = wr[i] + c * D::kBytes;
    step(src, c);
  }
  for (; c < c1; ++c) {
    const uint8_t* src[NB];
    for (int i = 0; i < NB; ++i) src[i] = step_ptr<D>(wr[i], c, rb, tmp[i]);
    step(src, c);
  }
}

// Steps [c0, c1) of one group (or row) into sum. Whole steps straight from the rows (row pointers in scalar
// registers: building a per-step pointer array made GCC keep it in vector registers and extract each pointer),
// prefetching the same bytes of the rows pf bytes on (Note [decode prefetch distance]); the tail through walk_steps.
template <class D, int MB, int NB, Acc A, bool kChecked>
__attribute__((always_inline)) inline void group_steps(F (&sum)[MB][NB], const D& dec, const uint8_t* const (&wr)[NB],
                                                       const float* const (&xr)[MB], const F (&sv)[NB],
                                                       uint8_t (&tmp)[NB][32], int64_t c0, int64_t c1, int64_t nfull,
                                                       int64_t rb, int64_t pf, NanTrack& nan) {
  int64_t c = c0;
  for (const int64_t cf = std::min(c1, nfull); c < cf; ++c) {
    const int64_t off = c * D::kBytes;
    if ((off & 63) < D::kBytes)
#pragma GCC unroll 4
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + off + pf), _MM_HINT_T1);
    dot_step<D, MB, NB, A, kChecked>(sum, dec, wr, off, xr, sv, c, nan);
  }
  if (c < c1)
    walk_steps<D, NB>(wr, tmp, c, c1, nfull, rb, [&](const uint8_t* const (&src)[NB], int64_t cc) {
      dot_step<D, MB, NB, A, true>(sum, dec, src, 0, xr, sv, cc, nan);
    });
}

// Note [Whole groups of a fixed step count]: with one token and groups of 1, 2 or 4 steps (g = 32 / 64 / 128:
// MX, intx g32, nf4 block 64, ...), the groups whose steps all lie inside the rows run as one flat loop with
// the group's steps unrolled (SPG a compile-time constant): the general loop re-entered group_steps' step loop
// and re-read its bounds once per group, which cost as much as the group's own decode at g = 32 / 64.
template <class D, int NB, int SPG>
__attribute__((always_inline)) inline void whole_groups(F (&acc)[1][NB], const D& dec, const uint8_t* const (&wr)[NB],
                                                        const float* const (&xr)[1], const float* const* srow,
                                                        int64_t g1, int64_t pf, NanTrack& nan) {
  const F one[NB] = {};  // unused: kGroup applies the scale once per group below
  for (int64_t gi = 0; gi < g1; ++gi) {
    F gacc[1][NB];
#pragma GCC unroll 4
    for (int i = 0; i < NB; ++i) gacc[0][i] = V::zero();
#pragma GCC unroll 4
    for (int s = 0; s < SPG; ++s) {
      const int64_t c = gi * SPG + s, off = c * D::kBytes;
      if ((off & 63) < D::kBytes)
#pragma GCC unroll 4
        for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + off + pf), _MM_HINT_T1);
      dot_step<D, 1, NB, Acc::kGroup, false>(gacc, dec, wr, off, xr, one, c, nan);
    }
#pragma GCC unroll 4
    for (int i = 0; i < NB; ++i) acc[0][i] = V::fmadd(gacc[0][i], V::set1(srow[i][gi]), acc[0][i]);
  }
}

// Groups [0, g1) through whole_groups when the step count per group is 1, 2 or 4; returns the groups done.
template <class D, int NB>
__attribute__((always_inline)) inline int64_t whole_groups_fixed(F (&acc)[1][NB], const D& dec,
                                                                 const uint8_t* const (&wr)[NB],
                                                                 const float* const (&xr)[1], const float* const* srow,
                                                                 int64_t spg, int64_t g1, int64_t pf, NanTrack& nan) {
  switch (spg) {
    case 1: whole_groups<D, NB, 1>(acc, dec, wr, xr, srow, g1, pf, nan); return g1;
    case 2: whole_groups<D, NB, 2>(acc, dec, wr, xr, srow, g1, pf, nan); return g1;
    case 4: whole_groups<D, NB, 4>(acc, dec, wr, xr, srow, g1, pf, nan); return g1;
    default: return 0;
  }
}

// n NVFP4 scale bytes e -> dst: each float8 e4m3 value / global, the reference's quotient (nvfp4_block_scale).
// V::L bytes at a time through fp16 as F8's e4m3 decode (value / 256, NaN codes given an all-ones exponent), times
// 256 (exact), divided by the global scale: one correctly rounded division, as the reference's.
inline void e4m3_quotients(const uint8_t* e, int64_t n, float global, float* dst) {
  const F g256 = V::set1(256.f), gv = V::set1(global);
  int64_t g = 0;
  for (; g + V::L <= n; g += V::L) {
    const V::H u = V::hi16<0>(e + g);
    V::H h = V::and_h(V::srai1_h(u), V::set1_h(static_cast<int16_t>(0xBFFF)));
    h = V::or_h(h, V::and_h(V::cmpeq_h(V::and_h(u, V::set1_h(0x7F00)), V::set1_h(0x7F00)), V::set1_h(0x7C00)));
    V::storeu(dst + g, V::div(V::mul(V::half_to_f(h), g256), gv));
  }
  for (; g < n; ++g) dst[g] = nvfp4_block_scale(e[g], global);
}

// Scales of the G groups of the row whose scale row starts at base, without scale_mul: the stored fp32 row
// itself, or E8M0 exponents / e4m3 bytes / double-quantized absmax decoded into dst (once per block of rows, in a
// loop the compiler vectorizes, so the dot loop reads one float per group and row).
inline const float* scale_row(const LowbitArgs& p, int64_t base, float* dst) {
  if (p.scale) return p.scale + base;
  if (p.scale_e4m3) {
    e4m3_quotients(p.scale_e4m3 + base, p.G, p.e4m3_global, dst);
    return dst;
  }
  if (p.scale_e8m0) {
    const uint8_t* e = p.scale_e8m0 + base;
    for (int64_t g = 0; g < p.G; ++g) {  // 2^(e - 127): float bits e << 23; e = 0 is the subnormal 2^-127
      const uint32_t bits = std::max<uint32_t>(static_cast<uint32_t>(e[g]) << 23, 0x00400000u);
      std::memcpy(dst + g, &bits, 4);
    }
    return dst;
  }
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t i = base + g;
    dst[g] = static_cast<float>(p.dq_codes[i]) * p.dq_scale[i >> 8] + p.dq_offset;
  }
  return dst;
}

// Rows [n0, n1) in blocks of kRows (their scale rows decoded once per block) x tokens in tiles of up to kMaxMB:
// tile(std::integral_constant<int, MB>, srow, m0, n0, nr) for each, so each token count is its own instantiation.
// The fp32 and the bf16 dot kernels both walk their output this way. scales = false: srow is all nullptr (a tile
// that reads its scales itself).
template <class Tile>
void for_each_tile(const LowbitArgs& p, int64_t n0, int64_t n1, const Tile& tile, bool scales = true) {
  AlignedVector<float> sbuf(scales ? kRows * p.G : 0);
  for (int64_t n = n0; n < n1; n += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, n1 - n));
    const float* srow[kRows] = {};
    for (int i = 0; i < (scales ? kRows : 0); ++i)
      srow[i] = scale_row(p, scale_base(p, n + std::min(i, nr - 1)), sbuf.data() + i * p.G);
    for (int64_t m = 0; m < p.M; m += kMaxMB) {
      switch (std::min<int64_t>(kMaxMB, p.M - m)) {
        case 1: tile(std::integral_constant<int, 1>{}, srow, m, n, nr); break;
        case 2: tile(std::integral_constant<int, 2>{}, srow, m, n, nr); break;
        case 3: tile(std::integral_constant<int, 3>{}, srow, m, n, nr); break;
        default: tile(std::integral_constant<int, 4>{}, srow, m, n, nr); break;
      }
    }
  }
}

// Note [decode prefetch distance]: the dot loop prefetches (into L2) the bytes that the next tile of NB rows will
// read at the same column, one tile ahead: rows are contiguous, so that is NB row strides on. A fixed 4 KiB
// (Note [decode prefetch] in int4_tiled_dot.inc) landed inside the current tile's own rows for rows of 2-4 KiB
// (nf4 / float8 at K = 4096), so half the prefetches fetched lines that the tile was already reading.
template <class D, int MB, int NB, Acc A, bool kChecked = false>
void dot_tile(const LowbitArgs& p, const D& dec, const float* const* srow, const float* xsum, int64_t m0, int64_t n0,
              int nr) {
  const int64_t nst = (p.K + kStep - 1) / kStep, rb = D::row_bytes(p), nfull = full_steps<D>(rb, nst);
  const int64_t spg = A == Acc::kRow ? nst : p.g / kStep;  // steps per group
  const uint8_t* wr[NB];
  int64_t base[NB];
  for (int i = 0; i < NB; ++i) {
    const int64_t n = n0 + std::min(i, nr - 1);  // a short tile repeats its last row
    wr[i] = p.w + n * p.ldw;
    base[i] = scale_base(p, n);
  }
  const float* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = p.x + (m0 + m) * p.ldx;
  F acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NB; ++i) acc[m][i] = V::zero();
  alignas(64) uint8_t tmp[NB][32];
  const int64_t pf = NB * p.ldw;
  NanTrack nan;
  F sv[NB];
  for (int i = 0; i < NB; ++i) sv[i] = V::set1(1.f);
  int64_t gdone = 0;  // Note [Whole groups of a fixed step count]
  if constexpr (A == Acc::kGroup && MB == 1 && !kChecked)
    gdone = whole_groups_fixed<D, NB>(acc, dec, wr, xr, srow, spg, std::min(nfull / spg, p.G), pf, nan);
  for (int64_t c0 = gdone * spg, gi = gdone; c0 < nst; c0 += spg, ++gi) {
    const int64_t c1 = std::min(nst, c0 + spg);
    if constexpr (A != Acc::kRow)
      for (int i = 0; i < NB; ++i) sv[i] = V::set1(srow[i][gi]);
    F gacc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int i = 0; i < NB; ++i) gacc[m][i] = V::zero();
    if constexpr (A == Acc::kGroup) group_steps<D, MB, NB, A, kChecked>(gacc, dec, wr, xr, sv, tmp, c0, c1, nfull, rb, pf, nan);
    else group_steps<D, MB, NB, A, kChecked>(acc, dec, wr, xr, sv, tmp, c0, c1, nfull, rb, pf, nan);
    if constexpr (A == Acc::kGroup)
#pragma GCC unroll 4
      for (int i = 0; i < NB; ++i) acc[0][i] = V::fmadd(gacc[0][i], sv[i], acc[0][i]);
  }
  if constexpr (kNanCodes<D> && !kChecked)
    if (nan.seen()) return dot_tile<D, MB, NB, A, true>(p, dec, srow, xsum, m0, n0, nr);  // Note [NaN codes off the hot loop]
  float red[MB][NB];  // every acc index a compile-time constant: Note [accumulators in registers]
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) red[m][i] = V::reduce(acc[m][i]);
  for (int i = 0; i < nr; ++i) {
    const float s = (A == Acc::kRow ? srow[i][0] : 1.f) * p.scale_mul;
    for (int m = 0; m < MB; ++m) {
      const float off = p.offset ? offset_dot(p.offset + base[i], xsum + (m0 + m) * p.G, p.G) : 0.f;
      store(p, m0 + m, n0 + i, red[m][i] * s + off);
    }
  }
}

// Rows [n0, n0 + nr) (nr <= kRows) x tokens [m0, m0 + MB), in tiles of kNB<MB> rows.
template <class D, int MB>
void dot_tiles(const LowbitArgs& p, const D& dec, const float* const* srow, const float* xsum, int64_t m0,
               int64_t n0, int nr) {
  constexpr int NB = kNB<MB>;
  for (int r = 0; r < nr; r += NB) {
    const int rr = std::min(NB, nr - r);
    if (p.G == 1) dot_tile<D, MB, NB, Acc::kRow>(p, dec, srow + r, xsum, m0, n0 + r, rr);
    else if constexpr (MB == 1) dot_tile<D, 1, NB, Acc::kGroup>(p, dec, srow + r, xsum, m0, n0 + r, rr);
    else dot_tile<D, MB, NB, Acc::kScaled>(p, dec, srow + r, xsum, m0, n0 + r, rr);
  }
}

// perm[t L + j]: the k within a step of the level in lane j of dot-order vector t (k itself for decoders in k order).
template <class D>
void dot_order_perm(int64_t* perm) {
  for (int t = 0; t < W; ++t)
    for (int j = 0; j < V::L; ++j) {
      if constexpr (D::kPermuted) perm[t * V::L + j] = D::k_of(t, j);
      else perm[t * V::L + j] = t * V::L + j;
    }
}

// Rows [n0, n1) x all tokens, in blocks of kRows rows x up to kMaxMB tokens. Groups must be whole steps (or one
// per row): see steps_aligned.
// p with x in the decoder's dot order, step by step (xperm holds it), or p itself for decoders in k order.
template <class D>
LowbitArgs dot_order_x(const LowbitArgs& p_in, AlignedVector<float>& xperm) {
  LowbitArgs p = p_in;
  if constexpr (D::kPermuted) {
    int64_t perm[kStep];
    dot_order_perm<D>(perm);
    xperm.resize(p.M * p.ldx);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t c = 0; c < p.ldx / kStep; ++c)
        for (int i = 0; i < kStep; ++i) xperm[m * p.ldx + c * kStep + i] = p.x[m * p.ldx + c * kStep + perm[i]];
    p.x = xperm.data();
  }
  return p;
}

template <class D>
void dot_aligned(const LowbitArgs& p_in, const D& dec, int64_t n0, int64_t n1) {
  const std::vector<float> xsum = group_sums(p_in);
  AlignedVector<float> xperm;
  const LowbitArgs p = dot_order_x<D>(p_in, xperm);
  for_each_tile(p, n0, n1, [&](auto mb, const float* const* srow, int64_t m, int64_t n, int nr) {
    dot_tiles<D, decltype(mb)::value>(p, dec, srow, xsum.data(), m, n, nr);
  });
}

// ================================================================ fp32 block decode
// Rows [n0, n1), columns [k0, k1) (k0 a multiple of kStep) -> dst[(n - n0) * ldd + (k - k0)], whole steps (up to
// k1 rounded up to kStep: ldd must leave room). Groups that are not whole steps get per-lane scales.
template <class D>
void decode_rows(const LowbitArgs& p, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* dst, int64_t ldd) {
  const D dec(p);
  const int64_t rb = D::row_bytes(p), c0 = k0 / kStep, c1 = (k1 + kStep - 1) / kStep;
  const bool aligned = steps_aligned(p);
  alignas(64) uint8_t tmp[32];
  alignas(64) float sl[kStep], ol[kStep];
  AlignedVector<float> sbuf(aligned ? 0 : p.G);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.ldw;
    float* d = dst + (n - n0) * ldd - k0;
    const int64_t base = scale_base(p, n);
    // Groups that are not whole steps (NVFP4's 16, nf4 block_size 16, ...): the row's scales decoded once, then
    // taken per half step (groups of 16) or looked up per lane.
    const float* srow = aligned ? nullptr : scale_row(p, base, sbuf.data());
    for (int64_t c = c0; c < c1; ++c) {
      F w[W];
      dec(step_ptr<D>(row, c, rb, tmp), w);
      if (aligned) {
        const int64_t gi = p.G == 1 ? 0 : c * kStep / p.g;
        const F s = V::set1(scale_at(p, base, gi)), o = V::set1(offset_at(p, base, gi));
        for (int t = 0; t < W; ++t) V::storeu(d + kStep * c + V::L * t, V::fmadd(w[t], s, o));
      } else if (p.g == 16) {  // vectors t < W / 2 hold the step's first group: Note [Groups of half a step]
        const int64_t g0 = std::min(2 * c, p.G - 1), g1 = std::min(2 * c + 1, p.G - 1);
        const F s0 = V::set1(srow[g0] * p.scale_mul), s1 = V::set1(srow[g1] * p.scale_mul);
        const F o0 = V::set1(offset_at(p, base, g0)), o1 = V::set1(offset_at(p, base, g1));
        for (int t = 0; t < W; ++t)
          V::storeu(d + kStep * c + V::L * t, V::fmadd(w[t], t < W / 2 ? s0 : s1, t < W / 2 ? o0 : o1));
      } else {
        for (int j = 0; j < kStep; ++j) {
          const int64_t gi = std::min((kStep * c + j) / p.g, p.G - 1);
          sl[j] = srow[gi] * p.scale_mul;
          ol[j] = offset_at(p, base, gi);
        }
        for (int t = 0; t < W; ++t)
          V::storeu(d + kStep * c + V::L * t, V::fmadd(w[t], V::loadu(sl + V::L * t), V::loadu(ol + V::L * t)));
      }
    }
  }
}

// ================================================================ dot-tile prefill
// A block of kPrefillRows rows x kPrefillK columns decoded to fp32 (L2), then the dot tiles run over it with
// kMaxMB tokens x kNB rows per tile (the x tile stays in L1), accumulating k blocks into the output.
template <class D>
void prefill(const LowbitArgs& p, int64_t n0, int64_t n1) {
  AlignedVector<float> buf(kPrefillRows * kPrefillK);
  const float one = 1.f;
  const F32 f32;
  for (int64_t b0 = n0; b0 < n1; b0 += kPrefillRows) {
    const int64_t nb = std::min<int64_t>(kPrefillRows, n1 - b0);
    for (int64_t k0 = 0; k0 < p.K; k0 += kPrefillK) {
      const int64_t kc = std::min<int64_t>(kPrefillK, p.K - k0);
      decode_rows<D>(p, b0, b0 + nb, k0, k0 + kc, buf.data(), kPrefillK);
      dot_aligned<F32>(block_args(p, buf.data(), &one, b0, nb, k0, kc), f32, 0, nb);
    }
  }
}

template <class D> struct DotOrderFn {
  static void run(const LowbitArgs&, int64_t* perm) { dot_order_perm<D>(perm); }
};

// Note [Groups of half a step]: NVFP4's groups of 16 (and nf4 block_size 16, intx / fp6 PerGroup(16)) split each decode
// step of 32 in two. The weights are still decoded in registers and each byte read once per tile of tokens (the dot
// kernel's shape, at read bandwidth), instead of the fp32 blocks of the prefill; each group's scale goes in per vector
// or per lane. The 4-bit decoders' dot orders keep the two groups apart (D::kG16): nf4 / fp4 on AVX-512 put k < 16
// in lanes j < 8 of both vectors (Lut4), so one vector of the two scales (V::halves: a broadcast and a masked one)
// serves the step; the AVX2 byte planes put it in vectors 0, 1 (PlaneLut4), each taking one broadcast scale; the
// other decoders run their k-order decode (operator(): vectors t < W / 2 hold the first group). With one token the
// products of the vectors sharing a scale are summed first and the sum multiplied into the row's accumulator by the
// scale (one FMA, Note [Group scales once per group]); with several the levels are scaled once and shared by the
// tokens. NVFP4's scales are looked up per step in the 256 quotients of its e4m3 bytes (G16Scales), not decoded into
// rows first. A step whose second half lies past K (K an odd multiple of 16) takes scale 0 there (its x lanes are zero
// padding anyway). 4096 x 4096 NVFP4, M = 1, one Zen 5 core, weights cached: AVX-512 1.01 ms in k order with scale
// rows, 0.43 ms in dot order, 0.36 ms with the looked-up scales; AVX2 1.64 -> 0.78 -> 0.66 ms.
template <class D, class = void> constexpr G16 kG16Of = G16::kKOrder;
template <class D> constexpr G16 kG16Of<D, std::void_t<decltype(D::kG16)>> = D::kG16;

// A tile's group scales: the decoded rows srow (scale_row), or for NVFP4 (kE4m3) each row's scale bytes er[i] looked
// up in q, the 256 quotients of e4m3_quotients (the same values, without a pass over the scale rows).
template <bool kE4m3>
struct G16Scales {
  const float* const* srow;
  const uint8_t* er[kRows];
  const float* q;
  // The scales of groups gi and gi + 1 of row i (a pointer each: V::set1 / V::halves read them as loads).
  __attribute__((always_inline)) const float* at(int i, int64_t gi) const {
    if constexpr (kE4m3) return q + er[i][gi];
    else return srow[i] + gi;
  }
};

// One step c of NB rows (row i's bytes at src[i]) x MB tokens; kTail: the step's second group may not exist, or its
// bytes come through step_ptr's copy.
template <class D, int MB, int NB, bool kTail, bool kE4m3>
__attribute__((always_inline)) inline void g16_step(F (&acc)[MB][NB], const D& dec, const uint8_t* const (&src)[NB],
                                                    const float* const (&xr)[MB], const G16Scales<kE4m3>& sc,
                                                    int64_t c, int64_t G) {
  constexpr G16 kOrder = kG16Of<D>;
  static const float zero = 0.f;
#pragma GCC unroll 4
  for (int i = 0; i < NB; ++i) {
    F w[W], sv[2];  // the scales of the vectors (kLaneHalves: lanes) of the step's first / second group
    if constexpr (kOrder == G16::kKOrder) dec(src[i], w);
    else dec.dot_order(src[i], w);
    const float* s0 = sc.at(i, 2 * c);
    const float* s1 = kTail && 2 * c + 1 >= G ? &zero : sc.at(i, 2 * c + 1);
    if constexpr (kOrder == G16::kLaneHalves) sv[0] = sv[1] = V::halves(s0, s1);
    else sv[0] = V::set1(*s0), sv[1] = V::set1(*s1);
    if constexpr (MB == 1) {
      F sum[2];
#pragma GCC unroll 4
      for (int t = 0; t < W; ++t) {
        const int h = kOrder == G16::kLaneHalves ? 0 : t / (W / 2);  // the sum of this vector's group
        const F x = V::loadu(xr[0] + kStep * c + V::L * t);
        sum[h] = t == (kOrder == G16::kLaneHalves ? 0 : h * (W / 2)) ? V::mul(x, w[t]) : V::fmadd(x, w[t], sum[h]);
      }
      acc[0][i] = V::fmadd(sum[0], sv[0], acc[0][i]);
      if constexpr (kOrder != G16::kLaneHalves) acc[0][i] = V::fmadd(sum[1], sv[1], acc[0][i]);
    } else {
#pragma GCC unroll 4
      for (int t = 0; t < W; ++t) w[t] = V::mul(w[t], sv[kOrder == G16::kLaneHalves ? 0 : t / (W / 2)]);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
        for (int t = 0; t < W; ++t) acc[m][i] = V::fmadd(V::loadu(xr[m] + kStep * c + V::L * t), w[t], acc[m][i]);
    }
  }
}

// p.x in D's dot order when D::kG16 says it is used (dot_g16).
template <class D, int MB, int NB, bool kE4m3>
void dot_tile_g16(const LowbitArgs& p, const D& dec, const float* const* srow, const float* q, int64_t m0, int64_t n0,
                  int nr) {
  const int64_t nst = (p.K + kStep - 1) / kStep, rb = D::row_bytes(p), nfull = full_steps<D>(rb, nst);
  const int64_t nfast = std::min(nfull, p.G / 2);  // steps with both groups, read straight from the rows
  const uint8_t* wr[NB];
  G16Scales<kE4m3> sc{srow, {}, q};
  for (int i = 0; i < NB; ++i) {
    const int64_t n = n0 + std::min(i, nr - 1);  // a short tile repeats its last row
    wr[i] = p.w + n * p.ldw;
    if constexpr (kE4m3) sc.er[i] = p.scale_e4m3 + scale_base(p, n);
  }
  const float* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = p.x + (m0 + m) * p.ldx;
  F acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NB; ++i) acc[m][i] = V::zero();
  alignas(64) uint8_t tmp[NB][32];
  const int64_t pf = NB * p.ldw;  // Note [decode prefetch distance]
  int64_t c = 0;
  for (; c < nfast; ++c) {
    const int64_t off = c * D::kBytes;
    if ((off & 63) < D::kBytes)
#pragma GCC unroll 4
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + off + pf), _MM_HINT_T1);
    const uint8_t* src[NB];
#pragma GCC unroll 4
    for (int i = 0; i < NB; ++i) src[i] = wr[i] + off;
    g16_step<D, MB, NB, false>(acc, dec, src, xr, sc, c, p.G);
  }
  for (; c < nst; ++c) {
    const uint8_t* src[NB];
    for (int i = 0; i < NB; ++i) src[i] = c < nfull ? wr[i] + c * D::kBytes : step_ptr<D>(wr[i], c, rb, tmp[i]);
    g16_step<D, MB, NB, true>(acc, dec, src, xr, sc, c, p.G);
  }
  float red[MB][NB];  // every acc index a compile-time constant: Note [accumulators in registers]
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) red[m][i] = V::reduce(acc[m][i]);
  for (int i = 0; i < nr; ++i)
    for (int m = 0; m < MB; ++m) store(p, m0 + m, n0 + i, red[m][i] * p.scale_mul);
}

template <class D, bool kE4m3>
void dot_g16_rows(const LowbitArgs& p, const D& dec, int64_t n0, int64_t n1) {
  alignas(64) float q[kE4m3 ? 256 : 1];
  if constexpr (kE4m3) {
    alignas(64) uint8_t bytes[256];
    for (int b = 0; b < 256; ++b) bytes[b] = static_cast<uint8_t>(b);
    e4m3_quotients(bytes, 256, p.e4m3_global, q);
  }
  for_each_tile(p, n0, n1, [&](auto mb, const float* const* srow, int64_t m, int64_t n, int nr) {
    constexpr int MB = decltype(mb)::value, NB = kNB<MB>;
    for (int r = 0; r < nr; r += NB)
      dot_tile_g16<D, MB, NB, kE4m3>(p, dec, srow + r, q, m, n + r, std::min(NB, nr - r));
  }, !kE4m3);
}

template <class D>
void dot_g16(const LowbitArgs& p_in, const D& dec, int64_t n0, int64_t n1) {
  AlignedVector<float> xperm;
  const LowbitArgs p = kG16Of<D> == G16::kKOrder ? p_in : dot_order_x<D>(p_in, xperm);
  if (p.scale_e4m3) dot_g16_rows<D, true>(p, dec, n0, n1);
  else dot_g16_rows<D, false>(p, dec, n0, n1);
}

// x times f (a power of two) into xs, when every product is exact (no finite |x| above 2^115: none overflows).
inline bool scaled_x(const LowbitArgs& p, float f, AlignedVector<float>& xs) {
  const int64_t n = p.M * p.ldx;
  for (int64_t i = 0; i < n; ++i)
    if (std::abs(p.x[i]) > 0x1p115f && !std::isinf(p.x[i])) return false;
  xs.resize(n);
  for (int64_t i = 0; i < n; ++i) xs[i] = p.x[i] * f;
  return true;
}

inline LowbitArgs with_x(const LowbitArgs& p, const float* x) {
  LowbitArgs q = p;
  q.x = x;
  return q;
}

// The dot kernel where groups are whole steps, or half steps without offsets (Note [Groups of half a step]); other
// group sizes (intx PerGroup(24), offsets with groups of 16, ...) run the prefill's decode-to-fp32 blocks, which
// scale per lane.
template <class D> struct DotFn {
  static void run(const LowbitArgs& p, int64_t n0, int64_t n1) {
    if constexpr (requires { typename D::Raw; }) {  // Note [FP6 through fp16]: x times 2^12 / 2^14 instead
      AlignedVector<float> xs;
      if (steps_aligned(p) && scaled_x(p, D::kRawScale, xs))
        return dot_aligned<typename D::Raw>(with_x(p, xs.data()), typename D::Raw(p), n0, n1);
    }
    if (steps_aligned(p)) dot_aligned<D>(p, D(p), n0, n1);
    else if (p.g == 16 && !p.offset) dot_g16<D>(p, D(p), n0, n1);
    else prefill<D>(p, n0, n1);
  }
};

// Whole rows up to K rounded up to kStep (a partial last step decodes step_ptr's zero padding: finite values).
template <class D> struct DecodeFn {
  static void run(const LowbitArgs& p, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
    decode_rows<D>(p, n0, n1, 0, p.K, dst, ldd);
  }
};
