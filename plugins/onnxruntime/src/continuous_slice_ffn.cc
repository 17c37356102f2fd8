// Both ops, float and quantized (SPEC §4, §6), share one computation over a weight format: a
// format hands out a register's worth of columns of a row as float (FloatRows: float or half; QuantRows: 8- or 4-bit
// integers times their block scale, w' = q * scale exactly as the reference dequantizes).
// Two paths, both touching only the union of the windows:
//  * decode (few tokens): per token, the rows its windows cover are cut into fixed chunks; each
//    chunk reads its w_in rows once, front to back (quantized rows on AVX-512: four runs of them
//    side by side), for dot products, applies bias, GELU and coverage, then reads its w_out rows
//    once the same way (into the chunk's partial output); partials are summed in chunk order.
//    Parallel over chunks, so one token uses every thread; memory bound, so the inner loops work
//    on whole registers of floats and nothing is converted or copied outside them.
//  * prefill (many tokens): tokens sorted by window position and grouped; per group, GEMMs
//    (Gemm: register blocks over the tokens, packed once) over the row ranges any of its tokens
//    cover, weighted by coverage, split over fixed blocks of hidden units whose partial outputs
//    are summed in block order. A block of half or quantized rows is first converted into float
//    scratch that stays in cache.
// QMatMul (a dense quantized matrix: the onnxruntime target's attention and LM head) reuses both
// paths with every row covered and nothing after the dot products.
// Work is split by token and by fixed row chunks, never by thread, so the summation order (and
// so every bit of the result) is the same for any number of threads.
//
// This file is compiled once per CPU variant (CMakeLists.txt: baseline, and on x86-64 also
// -march=x86-64-v3 and -march=x86-64-v4), each copy in its own namespace infmoe::INFMOE_VARIANT;
// dispatch.cc picks one at run time. Why the copies cannot leak into each other: see CMakeLists.txt.
#include "continuous_slice_ffn.h"

#include <Eigen/Core>
#if defined(__SSE2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef INFMOE_VARIANT
#error "compile with -DINFMOE_VARIANT=<name> (see CMakeLists.txt)"
#endif

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

using Index = Eigen::Index;
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXf;

// W floats as a GCC/Clang vector (one register of the variant). Each weight format picks its
// width: kNarrow for float weights, whose loops are memory bound (AVX-512 loads stream no faster
// than AVX2 ones here, measured: 25 against 19 GB/s at one thread on Zen 4), kWide for quantized
// ones, whose loops are bound by the widening arithmetic. A type wider than the registers would
// be split by the compiler through memory.
template <int W>
struct VectorOf {
  typedef float type __attribute__((vector_size(W * sizeof(float))));
};
template <int W>
using Lanes = typename VectorOf<W>::type;
#if defined(__AVX2__)
constexpr int kNarrow = 8;
#else
constexpr int kNarrow = 4;
#endif
#if defined(__AVX512F__)
constexpr int kWide = 16;
#else
constexpr int kWide = kNarrow;
#endif
typedef uint8_t Bytes __attribute__((vector_size(16)));
typedef int8_t SignedBytes __attribute__((vector_size(16)));
typedef uint64_t Words __attribute__((vector_size(16)));
// The same 16 bytes as the intrinsics' type.
#if defined(__SSE2__)
using NativeBytes = __m128i;
#elif defined(__ARM_NEON)
using NativeBytes = int8x16_t;
#else
using NativeBytes = SignedBytes;
#endif

constexpr int64_t kDecodeMaxTokens = 3;    // up to this many tokens: the decode path
// decode: weight bytes (w_in + w_out) per work item at most. 512 KB against 256 KB: 0.91-0.99x the
// time (longer streams); 1 MB: 2-4 % faster still at one thread, but few chunks to share (int4,
// K = 1: two).
constexpr int64_t kChunkBytes = 512 << 10;
constexpr int64_t kMaxChunkRows = 1024;
constexpr int64_t kFloatPrefetchBytes = 3072;  // decode, float rows on Intel (IntelStreams): prefetch distance
constexpr int64_t kPrefetchRows = 2;       // decode, quantized rows on AVX-512: prefetch distance
constexpr int64_t kGroupTokens = 128;      // prefill: tokens per GEMM group
constexpr int64_t kHiddenBlock = 512;      // prefill: hidden units per work item
constexpr int64_t kMergeGap = 32;          // prefill: fill uncovered gaps shorter than this
constexpr size_t kKeptPlan = 1024;         // decode: windows a thread keeps room for between calls

inline float ToFloat(float v) { return v; }
inline float ToFloat(uint16_t v) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(v)); }
inline void FromFloat(float v, float* dst) { *dst = v; }
inline void FromFloat(float v, uint16_t* dst) { *dst = Eigen::numext::bit_cast<uint16_t>(Eigen::half(v)); }

// The first W signed bytes as floats. GCC's generic vector conversion goes element by element,
// so the variants widen with their own instructions; a plain loop elsewhere.
template <int W>
inline Lanes<W> ToLanes(SignedBytes b) {
  const auto v = reinterpret_cast<NativeBytes>(b);
#if defined(__AVX512F__)
  if constexpr (W == 16) return reinterpret_cast<Lanes<W>>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)));
#endif
#if defined(__AVX2__)
  if constexpr (W == 8) return reinterpret_cast<Lanes<W>>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
#endif
#if defined(__SSE2__)
  if constexpr (W == 4) {  // no SSE4.1 sign extension: each byte to the top of an int32, then shift
    const __m128i doubled = _mm_unpacklo_epi8(v, v);
    return reinterpret_cast<Lanes<W>>(_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(doubled, doubled), 24)));
  }
#elif defined(__ARM_NEON)
  if constexpr (W == 4) return reinterpret_cast<Lanes<W>>(vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vget_low_s8(v))))));
#endif
  Lanes<W> out;
  for (int l = 0; l < W; ++l) out[l] = static_cast<float>(b[l]);
  return out;
}

// W halves as floats (F16C in the x86-64-v3 and v4 variants).
template <int W>
inline Lanes<W> ToLanes(const uint16_t* p) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    return reinterpret_cast<Lanes<W>>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
#endif
#if defined(__AVX2__)
  if constexpr (W == 8) return reinterpret_cast<Lanes<W>>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  Lanes<W> out;
  for (int l = 0; l < W; ++l) out[l] = ToFloat(p[l]);
  return out;
}

template <int W>
inline Lanes<W> ToLanes(const float* p) {
  Lanes<W> out;
  std::memcpy(&out, p, sizeof out);
  return out;
}

// Columns [u W, u W + n) of `row` as Lanes, zero beyond n. n is W except in a row's last, partial
// unit (read through a zero-padded copy, never past the row); callers pass the constant W in
// their main loop so the check folds away.
template <int W, typename T>
inline Lanes<W> LoadLanes(const T* row, int64_t u, int64_t n) {
  if (n == W) return ToLanes<W>(row + u * W);
  T padded[W] = {};  // +0.0 in float and in half
  std::copy(row + u * W, row + u * W + n, padded);
  return ToLanes<W>(padded);
}

// Weight formats. A unit is kWidth consecutive columns of a row. Values(row, u, n) gives unit u
// before scaling (zero beyond n) and Scale(row, b) the scale of the row's b-th block of
// 2^block_shift units, so that the GEMV loops apply a scale once per block, not once per weight.

// How float rows stream at decode on Intel's cores: two runs of a chunk's rows a pass (two
// streams, side by side: DotRows) and a software prefetch. Measured on a Xeon (AVX-512,
// 2026-12-03/04, bench_qop's layer, K 1/2/8, 1 and 2 threads, libraries interleaved call by
// call): with one run, the fp32 op 0.89-0.93x the time with prefetcht1 4 KB ahead (1 KB ahead
// 0.95-0.97x, 2 KB 0.89-0.93x, 8 KB as 4 KB), the fp16 op 0.77-0.81x; two runs without the
// prefetch 0.90-0.93x the time of one (four no better); two runs with the prefetch 3 KB ahead
// 0.88-0.94x the time of one run 4 KB ahead (fp32 and fp16; 2 KB 0.90-0.94x, 4 KB 0.96-0.98x,
// 8 KB 1.0x, prefetcht0 as t1, prefetchnta 3x slower). On Zen 4 prefetching 1-4 KB ahead made
// the one-run loops 1.02-1.2x slower and four runs 1.14-1.22x; two runs were not measured there,
// so other CPUs keep one run and no prefetch.
// Chosen once per process; INFMOE_INTEL_STREAMS=1 or 0 forces either way (tests: both paths on
// any CPU; the prefetch itself exists on x86-64 only).
bool IntelStreams() {
  static const bool on = [] {
    if (const char* forced = std::getenv("INFMOE_INTEL_STREAMS")) return std::strcmp(forced, "1") == 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") > 0;
#else
    return false;
#endif
  }();
  return on;
}

// A float [h, d] matrix (T = float, or half as uint16_t bits): one block, scale 1 (folded away).
// kIntel: decode streams it as IntelStreams() says (Run picks once per call).
template <typename T, bool kIntel = false>
struct FloatRows {
  static constexpr int kWidth = kNarrow;
  static constexpr int kDecodeRows = kIntel ? 2 : 1;
  using Row = const T*;
  const T* w;
  int64_t d;
  int block_shift = 62;
  Row At(int64_t i) const { return w + i * d; }
  Lanes<kWidth> Values(Row row, int64_t u, int64_t n) const { return LoadLanes<kWidth>(row, u, n); }
  float Scale(Row, int64_t) const { return 1.0f; }
  int64_t RowBytes() const { return d * static_cast<int64_t>(sizeof(T)); }
  // On Intel, when unit u of a row starts a cache line: the line kFloatPrefetchBytes ahead (into
  // the next rows of the run; a prefetch past the matrix never faults). The prefill's loops never
  // call it. asm, with the address as an integer, never a pointer past the matrix.
  void Prefetch(Row row, int64_t u) const {
#if defined(__x86_64__)
    if (kIntel && u * kWidth * sizeof(T) % 64 == 0)
      asm volatile("prefetcht1 (%0)" : : "r"(reinterpret_cast<uintptr_t>(row + u * kWidth) + kFloatPrefetchBytes));
#endif
  }
};

// A quantized [h, d] matrix (SPEC §6): unsigned storage with offset 2^(bits-1), int4 two columns
// per byte (even column in the low nibble), one scale per block of block_size columns. Rows lie
// `stride` bytes apart: `packed` (SPEC §6), or more for QMatMul's rows padded to whole blocks.
template <int Bits, typename T>
struct QuantRows {
  static constexpr int kWidth = kWide;
  static constexpr int kDecodeRows = 1;  // the arithmetic bounds them: one row a pass
  struct Row {
    const uint8_t* q;
    const T* scale;
  };
  const uint8_t* q;
  const T* scale;
  int64_t d, packed, blocks, stride;
  int block_shift;  // log2(block_size / kWidth): a unit never straddles two blocks (B >= 16 >= kWidth, powers of two)

  QuantRows(const QuantizedMatrix<T>& m, int64_t d_, int64_t block_size, int64_t stride_ = 0)
      : q(m.packed), scale(m.scale), d(d_), packed(Bits == 8 ? d_ : (d_ + 1) / 2),
        blocks((d_ + block_size - 1) / block_size), stride(stride_ ? stride_ : packed), block_shift(0) {
    while ((int64_t{kWidth} << block_shift) < block_size) ++block_shift;
  }
  Row At(int64_t i) const { return {q + i * stride, scale + i * blocks}; }
  float Scale(Row row, int64_t b) const { return ToFloat(row.scale[b]); }
  int64_t RowBytes() const { return stride + blocks * static_cast<int64_t>(sizeof(T)); }

  // The signed q of the unit, exact as floats.
  Lanes<kWidth> Values(Row row, int64_t u, int64_t n) const {
    constexpr int64_t kBytes = kWidth * Bits / 8;  // bytes per unit: 2 to 16
    const uint8_t* src = row.q + u * kBytes;
    Bytes b;
    if (n == kWidth) {
      if constexpr (kBytes == 16) {
        std::memcpy(&b, src, sizeof b);
      } else {
        uint64_t word = 0;
        std::memcpy(&word, src, kBytes);
        b = reinterpret_cast<Bytes>(Words{word, 0});
      }
    } else {  // the last unit of a row: its bytes, then stored zeros
      uint8_t padded[16];
      std::memset(padded, Bits == 8 ? 128 : 0x88, sizeof padded);
      std::memcpy(padded, src, (n * Bits + 7) / 8);
      std::memcpy(&b, padded, sizeof b);
    }
    if (Bits == 8) return ToLanes<kWidth>(reinterpret_cast<SignedBytes>(b ^ 128));
    // Byte j holds columns 2j (low nibble) and 2j + 1: one column per byte, in order.
    const Bytes low = b & 15, high = b >> 4;
    const Bytes columns = __builtin_shuffle(low, high, Bytes{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23});
    return ToLanes<kWidth>(reinterpret_cast<SignedBytes>(columns - 8));
  }
};

// w' of the unit, q * scale exactly as the reference dequantizes (prefill's scratch).
template <class Format>
inline Lanes<Format::kWidth> Dequantized(const Format& w, typename Format::Row row, int64_t u, int64_t n) {
  return w.Values(row, u, n) * w.Scale(row, u >> w.block_shift);
}

// Sum of the lanes in a fixed order (halves, then quarters, ...), in registers: through an array
// it cost a store-forwarding stall per row.
template <int W>
inline float SumLanes(Lanes<W> v) {
  if constexpr (W == 2) {
    return v[0] + v[1];
  } else {
    Lanes<W / 2> low, high;
    std::memcpy(&low, &v, sizeof low);
    std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
    return SumLanes<W / 2>(low + high);
  }
}

// GPT-2's tanh GELU, in place, vectorised by Eigen.
template <typename ArrayLike>
void GeluTanh(ArrayLike&& a) {
  const float sqrt_2_over_pi = 0.7978845608028654f;
  a = 0.5f * a * (1.0f + (sqrt_2_over_pi * (a + 0.044715f * a.cube())).tanh());
}

// coverage[i - lo] = (number of the k windows [s, s + r) covering unit i) / k, for i in [lo, hi).
// Form (docs/spec.md §6.3): the exact count n_i (small integers: exact in float), then
// n_i * (1/k): equal to n_i / k up to the last bit.
void Coverage(const int64_t* starts, int64_t k, int64_t r, int64_t lo, int64_t hi, float* coverage) {
  std::fill(coverage, coverage + (hi - lo), 0.0f);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t i = std::max(lo, starts[j]); i < std::min(hi, starts[j] + r); ++i) coverage[i - lo] += 1.0f;
  }
  const float per_window = 1.0f / static_cast<float>(k);
  for (int64_t i = 0; i < hi - lo; ++i) coverage[i] *= per_window;
}

struct Range {
  int64_t lo, hi;
};

// The runs of units covered by a token's windows, merged across gaps shorter than `gap`, in order
// (in place: Merge turns the windows into the runs).
void AddWindows(const int64_t* starts, int64_t k, int64_t r, std::vector<Range>& windows) {
  for (int64_t j = 0; j < k; ++j) windows.push_back({starts[j], starts[j] + r});
}
void Merge(std::vector<Range>& windows, int64_t gap) {
  std::sort(windows.begin(), windows.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  size_t runs = 0;
  for (const Range& w : windows) {  // run `runs` - 1 lies at or before w
    if (runs && w.lo - windows[runs - 1].hi < gap) {
      windows[runs - 1].hi = std::max(windows[runs - 1].hi, w.hi);
    } else {
      windows[runs++] = w;
    }
  }
  windows.resize(runs);
}

// ---- decode -------------------------------------------------------------------------------------

// The decode loops take Rows rows a pass, rows i + r stride for r = 0 .. Rows - 1 (Rows streams,
// each front to back through its own run of rows): dots[r stride] = row . x, and
// out += h[r stride] * row for each in that order (DecodeLayout::kRows: float rows two on Intel,
// one elsewhere; quantized rows four on AVX-512, PackedRows, one elsewhere; rows adjacent rather
// than runs apart, four streams 3 KB apart, streamed 2-10x slower from memory here).

// Float rows (one block, scale 1): the Rows rows side by side unit by unit, so the streams
// interleave at every load; each row has four accumulator chains (unit u into chain u mod 4, to
// hide the FMA latency), and at each unit out takes the rows' products in row order: every sum
// is bit for bit that of one whole row after another, which took 1.01-1.05x the time (Xeon,
// fp32, two runs, K 1/2/8, 1 and 2 threads, 2026-12-04).
template <int Rows, typename T, bool kIntel>
inline void DotRows(const FloatRows<T, kIntel>& w, int64_t i, int64_t stride, const Lanes<kNarrow>* x, int64_t full,
                    int64_t tail, float* dots) {
  constexpr int W = kNarrow;
  const T* row[Rows];
  // Indexed by constants only in the main loop (fully unrolled), so GCC keeps them in registers.
  Lanes<W> acc[Rows][4];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) {
    row[r] = w.At(i + r * stride);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) acc[r][k] = Lanes<W>{};
  }
  int64_t u = 0;
  for (; u + 4 <= full; u += 4) {
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) w.Prefetch(row[r], u + k);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[r][k] += w.Values(row[r], u + k, W) * x[u + k];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) {
    for (int64_t v = u; v < full; ++v) acc[r][v & 3] += w.Values(row[r], v, W) * x[v];
    if (tail) acc[r][full & 3] += w.Values(row[r], full, tail) * x[full];
    dots[r * stride] = SumLanes<W>((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]));
  }
}
template <int Rows, typename T, bool kIntel>
inline void AxpyRows(const FloatRows<T, kIntel>& w, int64_t i, int64_t stride, const float* h, int64_t full,
                     int64_t tail, Lanes<kNarrow>* out) {
  constexpr int W = kNarrow;
  const T* row[Rows];
  // The factors in registers: read through h, each store to out would reload them (they might alias).
  float c[Rows];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) row[r] = w.At(i + r * stride), c[r] = h[r * stride];
  int64_t u = 0;
  for (; u + 4 <= full; u += 4) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      Lanes<W> o = out[u + k];
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) w.Prefetch(row[r], u + k), o += c[r] * w.Values(row[r], u + k, W);
      out[u + k] = o;
    }
  }
  for (; u < full; ++u)
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) out[u] += c[r] * w.Values(row[r], u, W);
  if (tail)
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) out[full] += c[r] * w.Values(row[r], full, tail);
}

// Quantized rows: q . x per block, then one FMA by the block's scale (instead of scaling x per
// unit), blocks alternating between two chains. The arithmetic, not memory, bounds these loops.
template <int Bits, typename T>
inline float Dot(const QuantRows<Bits, T>& w, int64_t i, const Lanes<kWide>* x, int64_t full, int64_t tail) {
  constexpr int W = kWide;
  const typename QuantRows<Bits, T>::Row row = w.At(i);
  const int64_t per_block = int64_t{1} << w.block_shift;
  // Named chains, not an array indexed by b: GCC keeps an indexed array in memory.
  Lanes<W> even = {}, odd = {};
  int64_t b = 0;
  for (int64_t u = 0; u < full; ++b) {
    const int64_t end = std::min(u + per_block, full);
    Lanes<W> p = w.Values(row, u, W) * x[u];
    for (++u; u < end; ++u) p += w.Values(row, u, W) * x[u];
    (b & 1 ? odd : even) += p * w.Scale(row, b);
  }
  if (tail) even += (w.Values(row, full, tail) * x[full]) * w.Scale(row, full >> w.block_shift);
  return SumLanes<W>(even + odd);
}

// Quantized rows: out += h * row i, h times the block's scale once per block.
template <class Format>
inline void Axpy(const Format& w, int64_t i, float h, int64_t full, int64_t tail, Lanes<Format::kWidth>* out) {
  constexpr int W = Format::kWidth;
  const typename Format::Row row = w.At(i);
  const int64_t per_block = int64_t{1} << w.block_shift;
  for (int64_t lo = 0, b = 0; lo < full; lo += per_block, ++b) {
    const float c = h * w.Scale(row, b);
    for (int64_t u = lo; u < std::min(lo + per_block, full); ++u) out[u] += c * w.Values(row, u, W);
  }
  if (tail) out[full] += (h * w.Scale(row, full >> w.block_shift)) * w.Values(row, full, tail);
}

// Quantized rows through the natural layout: one row after another.
template <int Rows, class Format>
inline void DotRows(const Format& w, int64_t i, int64_t stride, const Lanes<Format::kWidth>* x, int64_t full,
                    int64_t tail, float* dots) {
  for (int r = 0; r < Rows; ++r) dots[r * stride] = Dot(w, i + r * stride, x, full, tail);
}
template <int Rows, class Format>
inline void AxpyRows(const Format& w, int64_t i, int64_t stride, const float* h, int64_t full, int64_t tail,
                     Lanes<Format::kWidth>* out) {
  for (int r = 0; r < Rows; ++r) Axpy(w, i + r * stride, h[r * stride], full, tail, out);
}

// What the decode loops read a format through: the format itself, except quantized rows on
// AVX-512 (below). Its register layout of a row: slot s, lane l holds column Column(s, l) (>= d:
// padding, where x is zero), x and the partial outputs stored times XScale(s) and 1 / XScale(s);
// natural: unit after unit, times 1.
template <class Format>
const Format& DecodeRows(const Format& w) {
  return w;
}
template <class Format>
struct DecodeLayout {
  static constexpr int kRows = Format::kDecodeRows;  // rows a pass
  static int64_t Slots(int64_t d) { return (d + Format::kWidth - 1) / Format::kWidth; }
  static int64_t Column(int64_t s, int l) { return s * Format::kWidth + l; }
  static float XScale(int64_t) { return 1.0f; }
  static constexpr bool kIntegerDot = false;  // x is slot(x, u) * XScale(u); else Layout::PackX
};

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// Quantized rows on AVX-512, without per-weight conversions. A row's 64-byte group g is 16 dwords
// of kPerDword = 32 / Bits stored values; value k of every dword is one register, as the float
// q 2^(Bits k') (k' = k mod half a dword: the upper half is shifted down 16 bits once per group).
//  * int8: masked into the mantissa of 2^23 (one vpternlogd) the field is the float
//    2^23 + u 2^(8 k'), and one subtraction of 2^23 + 2^(7 + 8 k') leaves q 2^(8 k') exactly.
//  * int4: the field shifted down to the low 4 bits indexes a vpermps table of q 2^(4 k'): shift,
//    vpermps, FMA. On Zen 4 integer and float vector ops share the four FP pipes, and vpternlogd
//    overwrites an input (a register copy per use): the mask costs 4 vector ops per 16 weights,
//    the table at most 3 (0.82-0.86x the time of a decode call, in cache and streamed).
// The power of two is undone on the other factor: x is stored times 2^-(Bits k'), the partial
// outputs are kept times 2^(Bits k') and scaled back once, in the final sum (powers of two:
// exact). So slot kPerDword g + k, lane l holds column 16 kPerDword g + kPerDword l + k (the layout of x
// and of the partial outputs); lane l of group g lies in block (16 kPerDword g + kPerDword l) /
// block_size, and ScaleLanes gives each lane its scale.
// kNibbles[k'][u] = (u - 8) 2^(4 k'): int4's q 2^(4 k') by stored nibble u (exact floats).
struct NibbleTables {
  alignas(64) float q[4][16];
  constexpr NibbleTables() : q{} {
    for (int k = 0; k < 4; ++k)
      for (int u = 0; u < 16; ++u) q[k][u] = static_cast<float>((u - 8) * (1 << (4 * k)));
  }
};
constexpr NibbleTables kNibbleTables;
constexpr const auto& kNibbles = kNibbleTables.q;

template <int Bits, typename T>
struct PackedRows {
  static constexpr int kWidth = 16;
  static constexpr int kPerDword = 32 / Bits, kHalf = kPerDword / 2, kGroupColumns = 16 * kPerDword;
  QuantRows<Bits, T> w;
  __m512i scale_index;  // lane l -> its block, counted from the group's first
  int64_t groups, full_groups;  // full_groups: those with 64 bytes (all but a partial last one)
  int64_t scales_per_group;     // blocks a group touches
  int block_log2;

  explicit PackedRows(const QuantRows<Bits, T>& rows) : w(rows) {
    groups = (w.d + kGroupColumns - 1) / kGroupColumns;
    full_groups = w.packed / 64;
    block_log2 = w.block_shift + 4;  // block_size = kWidth << block_shift
    scales_per_group = std::max(int64_t{kGroupColumns} >> block_log2, int64_t{1});
    alignas(64) int32_t index[16];
    for (int l = 0; l < 16; ++l) index[l] = (kPerDword * l) >> block_log2;
    scale_index = _mm512_load_si512(index);
  }
  // Software prefetch kPrefetchRows rows ahead in each stream (0.89-0.94x the time streamed,
  // 1.01x in cache; 4 rows ahead or more: less gain or slower); a prefetch never faults, past the
  // tensor's end neither. Row's scales here, its group g's bytes in Bytes.
  void Prefetch(typename QuantRows<Bits, T>::Row row) const {
    const char* scale = reinterpret_cast<const char*>(row.scale + kPrefetchRows * w.blocks);
    _mm_prefetch(scale, _MM_HINT_T0);
    _mm_prefetch(scale + w.blocks * sizeof(T) - 1, _MM_HINT_T0);
  }
  // Group g's 64 packed bytes; in the partial last group (tail) nothing past the row's end is
  // read: zero bytes.
  __m512i Bytes(const uint8_t* q, int64_t g, bool tail) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchRows * w.stride + 64 * g), _MM_HINT_T0);
    if (!tail) return _mm512_loadu_si512(q + 64 * g);
    return _mm512_maskz_loadu_epi8((__mmask64{1} << (w.packed - 64 * g)) - 1, q + 64 * g);
  }
  // Each lane's block scale in group g; tail: the row's last group, which may lack blocks.
  // Plain loads of exactly the group's scales where all are there (a masked load: 3-7 % slower
  // in cache), zero above them.
  __m512 ScaleLanes(const T* scale, int64_t g, bool tail) const {
    const int64_t first = (int64_t{kGroupColumns} * g) >> block_log2;
    const T* s = scale + first;
    if (tail) {
      const __mmask16 valid = static_cast<__mmask16>((1u << std::min(scales_per_group, w.blocks - first)) - 1);
      if constexpr (sizeof(T) == 4) return _mm512_permutexvar_ps(scale_index, _mm512_maskz_loadu_ps(valid, s));
      return _mm512_permutexvar_ps(scale_index, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, s)));
    }
    if (scales_per_group == 1) return _mm512_set1_ps(ToFloat(*s));
    __m512 scales;
    if constexpr (sizeof(T) == 4) {
      switch (scales_per_group) {
        case 2: scales = _mm512_castsi512_ps(_mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)))); break;
        case 4: scales = _mm512_zextps128_ps512(_mm_loadu_ps(s)); break;
        default: scales = _mm512_zextps256_ps512(_mm256_loadu_ps(s));  // 8
      }
    } else {
      __m128i halves;
      switch (scales_per_group) {
        case 2: {
          int32_t two;
          std::memcpy(&two, s, sizeof two);
          halves = _mm_cvtsi32_si128(two);
          break;
        }
        case 4: halves = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)); break;
        default: halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));  // 8
      }
      scales = _mm512_cvtph_ps(_mm256_zextsi128_si256(halves));
    }
    return _mm512_permutexvar_ps(scale_index, scales);
  }
  // q 2^(Bits k') of value k of every dword, from the group's bytes (low) and them >> 16 (high).
  static __m512 Q(__m512i low, __m512i high, int k) {
    const int shift = Bits * (k % kHalf);
    if constexpr (Bits == 4) {  // vpermps reads each lane's low 4 bits: the nibble, once shifted down
      const __m512i nibble = k < kHalf ? low : high;
      return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(nibble, shift) : nibble, _mm512_load_ps(kNibbles[k % kHalf]));
    }
    const __m512i field = _mm512_set1_epi32(((1 << Bits) - 1) << shift);
    const __m512i magic = _mm512_set1_epi32(0x4B000000);  // 2^23
    const __m512 offset = _mm512_set1_ps(8388608.0f + static_cast<float>(1 << (Bits - 1 + shift)));
    const __m512i bits = _mm512_ternarylogic_epi32(k < kHalf ? low : high, field, magic, 0xEA);  // (a & b) | c
    return _mm512_sub_ps(_mm512_castsi512_ps(bits), offset);
  }
  // 2^-(Bits k'): what undoes Q's power of two.
  static float Unscale(int64_t slot) { return 1.0f / static_cast<float>(1 << (Bits * (slot % kPerDword % kHalf))); }
};

// int8 too: 0.75x the time of its natural layout (vpmovsxbd, vcvtdq2ps, FMA) in cache and
// streamed, with four rows a pass as runs (below; adjacent rows side by side streamed 1.6x slower).
template <int Bits, typename T>
PackedRows<Bits, T> DecodeRows(const QuantRows<Bits, T>& w) {
  return PackedRows<Bits, T>(w);
}
template <int Bits, typename T>
struct DecodeLayout<PackedRows<Bits, T>> {
  using Rows = PackedRows<Bits, T>;
  // Four runs of a chunk's rows side by side, each front to back: x and the partial output are
  // loaded once for four rows, and the hardware prefetcher follows the four streams. Adjacent
  // rows side by side (one stream) streamed 1.1-1.6x slower from memory, software prefetch did
  // not help; against two adjacent rows a pass, int4: 0.97x the time in cache, 0.8-0.9x streamed.
  static constexpr int kRows = 4;
  static int64_t Slots(int64_t d) { return (d + Rows::kGroupColumns - 1) / Rows::kGroupColumns * Rows::kPerDword; }
  static int64_t Column(int64_t s, int l) {
    return s / Rows::kPerDword * Rows::kGroupColumns + Rows::kPerDword * l + s % Rows::kPerDword;
  }
  static float XScale(int64_t s) { return Rows::Unscale(s); }

  // int4 dot products in integers (AVX512-VNNI vpdpbusd: 64 byte products an instruction, where
  // the float loop makes 16 per FMA and needs a lookup per 16 weights). Per group g and lane l,
  // the lane's 8 columns c = 128 g + 8 l + j become integers X_c = x_c 2^-E, rounded (E per lane:
  // the largest |x| of the 8 maps to [2^21, 2^22), so |X| < 2^22 and each x moves by at most
  // 2^-22 of that largest, against the float loop's 2^-24 of each product; E >= -149), split
  // exactly into signed bytes X = a 2^16 + b 2^8 + c (|a| <= 64). The unsigned nibbles u = q + 8
  // times the bytes, summed per lane in int32 (below 2^30: no overflow), less the offset 8 sum X,
  // times 2^E as a float, then by the block scale: the lane's q . x with one rounding. A lane
  // holding a non-finite x gets 2^E = NaN, so its rows' dots are NaN.
  // Slots 8 g .. 8 g + 7: byte b of lane l of slot 8 g + i (i < 3) is byte i of X at column
  // 8 l + 2 b (low nibble), of slot 8 g + 3 + i at 8 l + 2 b + 1 (high nibble); slot 8 g + 6: the
  // offsets (int32), 8 g + 7: 2^E (float).
  static constexpr bool kIntegerDot = Bits == 4;
  // x: a token's d floats, zero-padded to whole groups of 128.
  static void PackX(const float* x, int64_t groups, Lanes<16>* slots) {
    const __m512i columns = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
    const __m512i byte = _mm512_set1_epi32(255), half = _mm512_set1_epi32(128);
    for (int64_t g = 0; g < groups; ++g) {
      __m512 v[8], largest = _mm512_setzero_ps();
      __mmask16 finite = 0xFFFF;
      for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_i32gather_ps(_mm512_add_epi32(columns, _mm512_set1_epi32(j)), x + 128 * g, 4);
        const __m512 magnitude = _mm512_abs_ps(v[j]);
        finite &= _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);  // false for NaN too
        largest = _mm512_max_ps(largest, magnitude);
      }
      const __m512 e = _mm512_max_ps(_mm512_sub_ps(_mm512_getexp_ps(largest), _mm512_set1_ps(21.0f)), _mm512_set1_ps(-149.0f));
      __m512i limbs[6] = {}, offset = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        __m512i rest = _mm512_maskz_cvtps_epi32(finite, _mm512_scalef_ps(v[j], _mm512_sub_ps(_mm512_setzero_ps(), e)));
        offset = _mm512_add_epi32(offset, rest);
        for (int i = 0; i < 3; ++i) {
          const __m512i digit = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(rest, half), byte), half);  // in [-128, 128)
          rest = _mm512_srai_epi32(_mm512_sub_epi32(rest, digit), 8);  // exact
          __m512i& limb = limbs[3 * (j & 1) + i];
          limb = _mm512_or_si512(limb, _mm512_slli_epi32(_mm512_and_si512(digit, byte), 8 * (j / 2)));
        }
      }
      Lanes<16>* out = slots + 8 * g;
      for (int i = 0; i < 6; ++i) _mm512_store_si512(out + i, limbs[i]);
      _mm512_store_si512(out + 6, _mm512_slli_epi32(offset, 3));
      _mm512_store_ps(out + 7, _mm512_mask_blend_ps(finite, _mm512_set1_ps(NAN), _mm512_scalef_ps(_mm512_set1_ps(1.0f), e)));
    }
  }
};

// Rows i + r stride (r < Rows) . x into dots[r stride], side by side: each x slot is loaded once
// for all of them and the rows are independent chains, each run its own stream. The lanes are
// summed for all rows at once at the end.
template <int Rows, int Bits, typename T>
inline void DotRows(const PackedRows<Bits, T>& n, int64_t i, int64_t stride, const Lanes<16>* x, int64_t, int64_t,
                    float* dots) {
  constexpr int K = PackedRows<Bits, T>::kPerDword;
  typename QuantRows<Bits, T>::Row row[Rows];
  for (int r = 0; r < Rows; ++r) row[r] = n.w.At(i + r * stride), n.Prefetch(row[r]);
  const __m512* xs = reinterpret_cast<const __m512*>(x);
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    __m512i low[Rows], high[Rows];
    __m512 p[Rows];
    for (int r = 0; r < Rows; ++r) low[r] = n.Bytes(row[r].q, g, tail), high[r] = _mm512_srli_epi32(low[r], 16);
    const __m512* xg = xs + K * g;
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const __m512 xk = xg[k];
      for (int r = 0; r < Rows; ++r) {
        p[r] = k ? _mm512_fmadd_ps(n.Q(low[r], high[r], k), xk, p[r]) : _mm512_mul_ps(n.Q(low[r], high[r], k), xk);
      }
    }
    for (int r = 0; r < Rows; ++r) acc[r] = _mm512_fmadd_ps(p[r], n.ScaleLanes(row[r].scale, g, tail), acc[r]);
  };
  int64_t g = 0;
  for (; g < n.full_groups; ++g) group(g, false);
  if (g < n.groups) group(g, true);
  for (int r = 0; r < Rows; ++r) dots[r * stride] = SumLanes<16>(reinterpret_cast<Lanes<16>>(acc[r]));
}

// int4: the same in integers (DecodeLayout::PackX above has how): per group and row, the nibbles
// times x's three bytes with six vpdpbusd, the bytes' weights applied by shifts in between.
template <int Rows, typename T>
inline void DotRows(const PackedRows<4, T>& n, int64_t i, int64_t stride, const Lanes<16>* x, int64_t, int64_t,
                    float* dots) {
  typename QuantRows<4, T>::Row row[Rows];
  for (int r = 0; r < Rows; ++r) row[r] = n.w.At(i + r * stride), n.Prefetch(row[r]);
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    const Lanes<16>* xg = x + 8 * g;
    for (int r = 0; r < Rows; ++r) {
      const __m512i bytes = n.Bytes(row[r].q, g, tail);
      const __m512i low = _mm512_and_si512(bytes, nibble), high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      __m512i sum = _mm512_setzero_si512();
      for (int i = 2; i >= 0; --i) {
        if (i < 2) sum = _mm512_slli_epi32(sum, 8);
        sum = _mm512_dpbusd_epi32(sum, low, _mm512_load_si512(xg + i));
        sum = _mm512_dpbusd_epi32(sum, high, _mm512_load_si512(xg + 3 + i));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_load_si512(xg + 6)));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_load_ps(xg + 7)), n.ScaleLanes(row[r].scale, g, tail), acc[r]);
    }
  };
  int64_t g = 0;
  for (; g < n.full_groups; ++g) group(g, false);
  if (g < n.groups) group(g, true);
  for (int r = 0; r < Rows; ++r) dots[r * stride] = SumLanes<16>(reinterpret_cast<Lanes<16>>(acc[r]));
}

// Several rows per pass, one after the other per register: fewer loads and stores of out (its
// stores bound the one-row loop), the same sums as one row at a time. out holds the partial
// output times 2^(Bits k') (exact: a power of two), so Q needs no unscaling here.
template <int Rows, int Bits, typename T>
inline void AxpyRows(const PackedRows<Bits, T>& n, int64_t i, int64_t stride, const float* h, int64_t, int64_t,
                     Lanes<16>* out) {
  constexpr int K = PackedRows<Bits, T>::kPerDword;
  typename QuantRows<Bits, T>::Row row[Rows];
  for (int r = 0; r < Rows; ++r) row[r] = n.w.At(i + r * stride), n.Prefetch(row[r]);
  __m512* o = reinterpret_cast<__m512*>(out);
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    __m512i low[Rows], high[Rows];
    __m512 c[Rows];
    for (int r = 0; r < Rows; ++r) {
      low[r] = n.Bytes(row[r].q, g, tail), high[r] = _mm512_srli_epi32(low[r], 16);
      c[r] = _mm512_mul_ps(_mm512_set1_ps(h[r * stride]), n.ScaleLanes(row[r].scale, g, tail));
    }
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      __m512 sum = o[K * g + k];
      for (int r = 0; r < Rows; ++r) sum = _mm512_fmadd_ps(c[r], n.Q(low[r], high[r], k), sum);
      o[K * g + k] = sum;
    }
  };
  int64_t g = 0;
  for (; g < n.full_groups; ++g) group(g, false);
  if (g < n.groups) group(g, true);
}
#endif

// Slot u of d values v in the decode layout of Rows, v read as Format's element type (zero at
// padding).
template <class Rows, class Format, typename T>
Lanes<Rows::kWidth> Slot(const T* v, int64_t d, int64_t u) {
  constexpr int W = Rows::kWidth;
  if constexpr (std::is_same_v<Rows, Format>) return LoadLanes<W>(v, u, u < d / W ? W : d % W);
  Lanes<W> out;
  for (int l = 0; l < W; ++l) {
    const int64_t column = DecodeLayout<Rows>::Column(u, l);
    out[l] = column < d ? ToFloat(v[column]) : 0.0f;
  }
  return out;
}

// The tokens of x [tokens, d] in the decode layout of Rows, Layout::Slots(d) slots a token: the
// integers of Layout::PackX, or the floats times XScale.
template <class Rows, class Format, typename T>
std::vector<Lanes<Rows::kWidth>> DecodeX(const T* x, int64_t tokens, int64_t d) {
  using Layout = DecodeLayout<Rows>;
  constexpr int W = Rows::kWidth;
  const int64_t units = Layout::Slots(d);
  std::vector<Lanes<W>> xs(tokens * units);
  for (int64_t t = 0; t < tokens; ++t) {
    if constexpr (Layout::kIntegerDot) {
      std::vector<float> padded(units * W, 0.0f);
      for (int64_t c = 0; c < d; ++c) padded[c] = ToFloat(x[t * d + c]);
      Layout::PackX(padded.data(), units / Rows::kPerDword, xs.data() + t * units);
    } else {
      for (int64_t u = 0; u < units; ++u) xs[t * units + u] = Slot<Rows, Format>(x + t * d, d, u) * Layout::XScale(u);
    }
  }
  return xs;
}

// dots[i] = row lo + i . x for i < rows: Layout::kRows runs of the rows side by side, then the
// rest one by one.
template <class Rows>
void DotChunk(const Rows& w, int64_t lo, int64_t rows, const Lanes<Rows::kWidth>* x, int64_t full, int64_t tail,
              float* dots) {
  constexpr int kRows = DecodeLayout<Rows>::kRows;
  const int64_t run = rows / kRows;
  for (int64_t i = 0; i < run; ++i) DotRows<kRows>(w, lo + i, run, x, full, tail, dots + i);
  for (int64_t i = kRows * run; i < rows; ++i) DotRows<1>(w, lo + i, 0, x, full, tail, dots + i);
}

template <typename T, class Format>
void Decode(const Sizes& s, const T* x, const int64_t* starts, const Format& format_in, const T* b_in,
            const Format& format_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  const auto& w_in = DecodeRows(format_in);
  const auto& w_out = DecodeRows(format_out);
  using Rows = std::decay_t<decltype(w_in)>;
  using Layout = DecodeLayout<Rows>;
  constexpr int W = Rows::kWidth;
  const int64_t full = s.d / W, tail = s.d % W, units = Layout::Slots(s.d);
  // Chunks of a fixed number of rows (from the format's row size, never from the thread count).
  const int64_t chunk_rows =
      std::clamp<int64_t>(kChunkBytes / (format_in.RowBytes() + format_out.RowBytes()), 1, kMaxChunkRows);
  struct Chunk {
    int64_t token, lo, hi;
  };
  // The plan in vectors the calling thread keeps (a call allocates no more once they have grown:
  // a small model's step calls this op a dozen times). The work items, run on the pool's threads
  // too, reach the caller's through the reference.
  thread_local std::vector<Chunk> thread_chunks;
  thread_local std::vector<Range> windows;
  std::vector<Chunk>& chunks = thread_chunks;
  chunks.clear();
  size_t first_chunk[kDecodeMaxTokens + 1] = {};
  for (int64_t t = 0; t < s.tokens; ++t) {
    windows.clear();
    AddWindows(starts + t * s.k, s.k, s.r, windows);
    Merge(windows, 1);
    for (const Range& run : windows) {
      // The fewest chunks of at most chunk_rows rows, rounded up to an even number (two threads
      // split a run evenly), all of one size (+-1 row).
      const int64_t length = run.hi - run.lo;
      int64_t n = (length + chunk_rows - 1) / chunk_rows;
      n = std::min(n + (n > 1 && n % 2), length);
      for (int64_t j = 0; j < n; ++j) chunks.push_back({t, run.lo + length * j / n, run.lo + length * (j + 1) / n});
    }
    first_chunk[t + 1] = chunks.size();
  }
  const std::vector<Lanes<W>> xs = DecodeX<Rows, Format>(x, s.tokens, s.d);

  // Every chunk writes its whole partial: no zeroing here (a memset of all of them per call).
  const std::unique_ptr<Lanes<W>[]> partials(new Lanes<W>[chunks.size() * units]);
  parallel_for(chunks.size(), [&](size_t index) {
    const Chunk& c = chunks[index];
    const Lanes<W>* xt = &xs[c.token * units];
    Lanes<W>* out = &partials[index * units];
    float hidden[kMaxChunkRows], coverage[kMaxChunkRows];
    const int64_t rows = c.hi - c.lo;
    DotChunk(w_in, c.lo, rows, xt, full, tail, hidden);
    for (int64_t i = 0; i < rows; ++i) hidden[i] += ToFloat(b_in[c.lo + i]);
    Eigen::Map<Eigen::ArrayXf> h(hidden, rows);
    GeluTanh(h);
    Coverage(starts + c.token * s.k, s.k, s.r, c.lo, c.hi, coverage);
    h *= Eigen::Map<const Eigen::ArrayXf>(coverage, rows);
    std::fill(out, out + units, Lanes<W>{});
    constexpr int kRows = Layout::kRows;
    const int64_t run = rows / kRows;
    for (int64_t i = 0; i < run; ++i) AxpyRows<kRows>(w_out, c.lo + i, run, hidden + i, full, tail, out);
    for (int64_t i = kRows * run; i < rows; ++i) AxpyRows<1>(w_out, c.lo + i, 0, hidden + i, full, tail, out);
  });

  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t u = 0; u < units; ++u) {
      // The partials are stored divided by XScale (powers of two: exact), so is b_out here.
      Lanes<W> sum = Slot<Rows, Format>(b_out, s.d, u) / Layout::XScale(u);
      for (size_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) sum += partials[c * units + u];
      sum *= Layout::XScale(u);
      for (int l = 0; l < W; ++l) {
        const int64_t column = Layout::Column(u, l);
        if (column < s.d) FromFloat(sum[l], y + t * s.d + column);
      }
    }
  }
  // A plan this large came from thousands of windows a token: not kept for the thread's next call.
  if (windows.capacity() > kKeptPlan) std::vector<Range>().swap(windows), std::vector<Chunk>().swap(chunks);
}

// ---- prefill ------------------------------------------------------------------------------------

// Rows [lo, hi) as floats, d apart: the float data itself, or converted into scratch.
const float* Rows(const FloatRows<float>& w, int64_t lo, int64_t, RowMatrix&) { return w.w + lo * w.d; }
// Row i of w as d floats (w' for quantized rows).
template <class Format>
void DequantizeRow(const Format& w, int64_t i, float* dst) {
  constexpr int W = Format::kWidth;
  const typename Format::Row row = w.At(i);
  for (int64_t u = 0; u < (w.d + W - 1) / W; ++u) {
    const int64_t n = std::min<int64_t>(W, w.d - u * W);
    const Lanes<W> v = Dequantized(w, row, u, n);
    if (n == W) {  // a constant size: one store, not a call to memcpy
      std::memcpy(dst + u * W, &v, sizeof v);
    } else {
      std::memcpy(dst + u * W, &v, n * sizeof(float));
    }
  }
}
template <class Format>
const float* Rows(const Format& w, int64_t lo, int64_t hi, RowMatrix& scratch) {
  scratch.resize(hi - lo, w.d);
  for (int64_t i = lo; i < hi; ++i) DequantizeRow(w, i, scratch.row(i - lo).data());
  return scratch.data();
}

// The GEMMs of prefill, our own rather than Eigen's: it takes the weights as they lie (float rows)
// or as dequantized into scratch, where Eigen packs them once more (QMatMul took 1.14-1.26x the
// time of onnxruntime's MLAS on a prepacked float weight with Eigen, ~1.0x with this;
// docs/onnxruntime-kernel.md). The tokens are packed once, across the lanes (PackTokens); per
// tile of kTileTokens tokens and strip of kStripColumns output columns, one register block of
// sums runs over the whole depth in order: every output is its own sum, bitwise the same
// for any number of threads.
constexpr int kGemmLanes = kWide;
constexpr int kTileVectors = 2;  // 3 x 8 and 4 x 6 (x 16 lanes) were no faster, 1 x 28 spilled
constexpr int kTileTokens = kTileVectors * kGemmLanes;
constexpr int kStripColumns = kGemmLanes == 16 ? 12 : 6;  // 24 or 12 accumulators: the registers

// Tokens t < tokens, row(t) their depth values (float or half), as tiles: tile i, column c,
// lane l = row(kTileTokens i + l)[c], zero past the last token.
template <typename Row>
std::vector<float> PackTokens(int64_t tokens, int64_t depth, Row row) {
  std::vector<float> packed((tokens + kTileTokens - 1) / kTileTokens * depth * kTileTokens, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    float* dst = &packed[t / kTileTokens * depth * kTileTokens + t % kTileTokens];
    const auto* v = row(t);
    for (int64_t c = 0; c < depth; ++c) dst[c * kTileTokens] = ToFloat(v[c]);
  }
  return packed;
}

// out[j][l] = tile token l . B column j over depth, B(j, c) = b[j][c] (kRows: b's rows, ld apart,
// as in x . w^T) or b[c][j] (x . w, w's rows ld apart).
template <bool kRows>
inline void GemmTile(const float* tile, const float* b, int64_t ld, int64_t depth, float (*out)[kTileTokens]) {
  constexpr int W = kGemmLanes;
  // Indexed, but fully unrolled, so GCC keeps them in registers.
  Lanes<W> acc[kTileVectors][kStripColumns];
#pragma GCC unroll 16
  for (int j = 0; j < kStripColumns; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < kTileVectors; ++v) acc[v][j] = Lanes<W>{};
  for (int64_t c = 0; c < depth; ++c) {
    Lanes<W> a[kTileVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kTileVectors; ++v) a[v] = ToLanes<W>(tile + c * kTileTokens + v * W);
#pragma GCC unroll 16
    for (int j = 0; j < kStripColumns; ++j) {
      const float factor = kRows ? b[j * ld + c] : b[c * ld + j];
#pragma GCC unroll 4
      for (int v = 0; v < kTileVectors; ++v) acc[v][j] += a[v] * factor;
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < kStripColumns; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < kTileVectors; ++v) std::memcpy(out[j] + v * W, &acc[v][j], sizeof acc[v][j]);
}

// y[t, j] = packed token t . B column j for t < tokens, j < columns (B as in GemmTile), y's rows
// ldy apart, float or half. A last, partial strip is read from a zero-padded copy: never past
// B's end.
template <bool kRows, typename Y>
void Gemm(const std::vector<float>& packed, int64_t tokens, int64_t depth, const float* b, int64_t ld,
          int64_t columns, Y* y, int64_t ldy) {
  const int64_t full = columns / kStripColumns * kStripColumns, rest = columns - full;
  std::vector<float> last(rest ? kStripColumns * depth : 0, 0.0f);  // kRows: [strip][depth], else [depth][strip]
  for (int64_t j = 0; j < rest; ++j) {
    for (int64_t c = 0; c < depth; ++c) {
      if constexpr (kRows) {
        last[j * depth + c] = b[(full + j) * ld + c];
      } else {
        last[c * kStripColumns + j] = b[c * ld + full + j];
      }
    }
  }
  alignas(64) float out[kStripColumns][kTileTokens];
  for (int64_t first = 0; first < tokens; first += kTileTokens) {
    const float* tile = &packed[first * depth];
    for (int64_t j0 = 0; j0 < columns; j0 += kStripColumns) {
      if (j0 < full) {
        GemmTile<kRows>(tile, kRows ? b + j0 * ld : b + j0, ld, depth, out);
      } else {
        GemmTile<kRows>(tile, last.data(), kRows ? depth : kStripColumns, depth, out);
      }
      const int64_t n = std::min<int64_t>(kStripColumns, columns - j0);
      for (int64_t l = 0; l < std::min<int64_t>(kTileTokens, tokens - first); ++l) {
        for (int64_t j = 0; j < n; ++j) FromFloat(out[j][l], y + (first + l) * ldy + j0 + j);
      }
    }
  }
}

template <typename T>
Vector ToVector(const T* v, int64_t n) {
  Vector out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = ToFloat(v[i]);
  return out;
}

template <typename T, class Format>
void Prefill(const Sizes& s, const T* x, const int64_t* starts, const Format& w_in, const T* b_in,
             const Format& w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  // Tokens whose windows start close together share a group, so its span stays narrow.
  std::vector<int64_t> order(s.tokens);
  std::iota(order.begin(), order.end(), 0);
  std::vector<int64_t> first(s.tokens);
  for (int64_t t = 0; t < s.tokens; ++t) first[t] = *std::min_element(starts + t * s.k, starts + (t + 1) * s.k);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return first[a] < first[b]; });

  const Vector bias_in = ToVector(b_in, s.h);
  const Vector bias_out = ToVector(b_out, s.d);
  RowMatrix coverage, yg, partials;
  for (int64_t begin = 0; begin < s.tokens; begin += kGroupTokens) {
    const int64_t n = std::min(kGroupTokens, s.tokens - begin);
    coverage.resize(n, s.h);
    std::vector<Range> windows;
    for (int64_t g = 0; g < n; ++g) {
      const int64_t t = order[begin + g];
      Coverage(starts + t * s.k, s.k, s.r, 0, s.h, coverage.row(g).data());
      AddWindows(starts + t * s.k, s.k, s.r, windows);
    }
    yg = bias_out.transpose().replicate(n, 1);
    const std::vector<float> packed_x = PackTokens(n, s.d, [&](int64_t g) { return x + order[begin + g] * s.d; });
    Merge(windows, kMergeGap);
    for (const Range& range : windows) {
      // One work item per block of hidden units: GEMM, bias, GELU, coverage, then the block's
      // partial output (a second GEMM); partials are added in block order afterwards.
      const int64_t rows = range.hi - range.lo;
      const int64_t blocks = (rows + kHiddenBlock - 1) / kHiddenBlock;
      partials.resize(blocks * n, s.d);
      parallel_for(static_cast<size_t>(blocks), [&](size_t block) {
        const int64_t lo = range.lo + static_cast<int64_t>(block) * kHiddenBlock;
        const int64_t hi = std::min(lo + kHiddenBlock, range.hi);
        RowMatrix scratch, hidden(n, hi - lo);
        Gemm<true>(packed_x, n, s.d, Rows(w_in, lo, hi, scratch), s.d, hi - lo, hidden.data(), hi - lo);
        hidden.rowwise() += bias_in.segment(lo, hi - lo).transpose();
        GeluTanh(hidden.array());
        hidden.array() *= coverage.middleCols(lo, hi - lo).array();
        Gemm<false>(PackTokens(n, hi - lo, [&](int64_t t) { return hidden.row(t).data(); }), n, hi - lo,
                    Rows(w_out, lo, hi, scratch), s.d, s.d, partials.row(static_cast<Index>(block) * n).data(), s.d);
      });
      for (int64_t block = 0; block < blocks; ++block) yg += partials.middleRows(block * n, n);
    }
    for (int64_t g = 0; g < n; ++g) {
      for (int64_t j = 0; j < s.d; ++j) FromFloat(yg(g, j), y + order[begin + g] * s.d + j);
    }
  }
}

template <typename T, class Format>
void Compute(const Sizes& s, const T* x, const int64_t* starts, const Format& w_in, const T* b_in,
             const Format& w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  if (s.tokens == 0) return;
  if (s.tokens <= kDecodeMaxTokens) {
    Decode(s, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
  } else {
    Prefill(s, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
  }
}

// ---- QMatMul ------------------------------------------------------------------------------------

// At least this many work items a call: a 768-row matrix still splits evenly over 2 or 4 threads.
constexpr int64_t kMatMulItems = 8;
constexpr int64_t kMatMulRows = 48;  // prefill: rows per work item (4 strips; scratch in cache)

// Few tokens: each work item a fixed range of rows, read once for all tokens (the range stays in
// cache between them). Every dot is one row's own sum, so no split changes a bit.
template <typename T, class Format>
void DecodeMatMul(const MatMulSizes& s, const T* x, const Format& format, T* y, const ParallelFor& parallel_for) {
  const auto& w = DecodeRows(format);
  using Rows = std::decay_t<decltype(w)>;
  constexpr int W = Rows::kWidth;
  const std::vector<Lanes<W>> xs = DecodeX<Rows, Format>(x, s.tokens, s.k);
  const int64_t units = DecodeLayout<Rows>::Slots(s.k);
  const int64_t rows = std::clamp<int64_t>(
      std::min(kChunkBytes / format.RowBytes(), (s.n + kMatMulItems - 1) / kMatMulItems), 1, kMaxChunkRows);
  parallel_for(static_cast<size_t>((s.n + rows - 1) / rows), [&](size_t item) {
    const int64_t lo = static_cast<int64_t>(item) * rows, hi = std::min(lo + rows, s.n);
    float dots[kMaxChunkRows];
    for (int64_t t = 0; t < s.tokens; ++t) {
      DotChunk(w, lo, hi - lo, xs.data() + t * units, s.k / W, s.k % W, dots);
      for (int64_t j = lo; j < hi; ++j) FromFloat(dots[j - lo], y + t * s.n + j);
    }
  });
}

// Many tokens: per work item of kMatMulRows rows, dequantized once into scratch, one Gemm.
template <typename T, class Format>
void PrefillMatMul(const MatMulSizes& s, const T* x, const Format& w, T* y, const ParallelFor& parallel_for) {
  const std::vector<float> packed = PackTokens(s.tokens, s.k, [&](int64_t t) { return x + t * s.k; });
  parallel_for(static_cast<size_t>((s.n + kMatMulRows - 1) / kMatMulRows), [&](size_t item) {
    const int64_t lo = static_cast<int64_t>(item) * kMatMulRows, rows = std::min(kMatMulRows, s.n - lo);
    RowMatrix scratch;
    Gemm<true>(packed, s.tokens, s.k, Rows(w, lo, lo + rows, scratch), s.k, rows, y + lo, s.n);
  });
}

template <typename T, class Format>
void ComputeMatMul(const MatMulSizes& s, const T* x, const Format& w, T* y, const ParallelFor& parallel_for) {
  if (s.tokens == 0 || s.n == 0) return;
  if (s.tokens <= kDecodeMaxTokens) {
    DecodeMatMul(s, x, w, y, parallel_for);
  } else {
    PrefillMatMul(s, x, w, y, parallel_for);
  }
}

// ---- DecoderAttention ---------------------------------------------------------------------------
// Causal attention over a KV cache (docs/onnxruntime-kernel.md, DecoderAttention): per batch row b
// and head h, the new keys and values go into present at positions [past_b, past_b + S); query i
// attends keys j <= past_b + i (j < total_b), scores q . k / sqrt(head_dim) + bias, softmax, times
// the values. Work items are (row, head) pairs, or (row, head, block of queries) in prefill: each
// output is computed by one item in a fixed order, so any thread count gives the same bits.

constexpr int64_t kAttentionQueries = 64;  // prefill: queries an item takes (scores [64, total] in cache)
// Below this many multiply-adds a call stays on the calling thread: a small model's decode step
// (12 heads of 8 over 128 keys: 25 K) costs less than waking the pool.
constexpr int64_t kAttentionInline = int64_t{1} << 16;

// p[j] = exp(p[j] - max) / sum over j < n, in place (Eigen's vectorised exp). p must be aligned as
// Eigen's own arrays are: Eigen takes the elements before the first aligned one by its scalar exp
// and sums in another order, so an unaligned p would change bits with the address.
void Softmax(float* p, int64_t n) {
  Eigen::Map<Eigen::ArrayXf, Eigen::AlignedMax> a(p, n);
  a = (a - a.maxCoeff()).exp();
  a *= 1.0f / a.sum();
}

// x and y hold W / M keys each, M partial sums a key side by side: one register of their 2 W / M
// keys (x's first), M / 2 sums each, partial p + M / 2 added to partial p.
template <int W, int M, size_t... I>
inline Lanes<W> Fold(Lanes<W> x, Lanes<W> y, std::index_sequence<I...>) {
  constexpr int kHalf = M / 2, kKeys = W / M;
  constexpr auto source = [](int i) {
    const int key = i / kHalf, p = i % kHalf;
    return key < kKeys ? key * M + p : W + (key - kKeys) * M + p;
  };
  return __builtin_shufflevector(x, y, source(I)...) + __builtin_shufflevector(x, y, (source(I) + kHalf)...);
}

// v[r]: key r's W partial sums (r < W) -> lane r of one register: key r's sum (v is overwritten).
template <int W, int M = W>
inline Lanes<W> KeySums(Lanes<W>* v) {
  if constexpr (M == 1) {
    return v[0];
  } else {
    for (int i = 0; i < M / 2; ++i) v[i] = Fold<W, M>(v[2 * i], v[2 * i + 1], std::make_index_sequence<W>{});
    return KeySums<W, M / 2>(v);
  }
}

// scores[j] = q . key j for j < n, keys ld floats apart: W keys a pass (independent chains hide
// the FMA latency; their lanes summed together by KeySums, not a key at a time), then one at a time.
void Scores(const float* q, const float* keys, int64_t ld, int64_t n, int64_t dim, float* scores) {
  constexpr int W = kNarrow;
  const int64_t full = dim / W * W;
  auto tail = [&](int64_t j) { float sum = 0.0f; for (int64_t c = full; c < dim; ++c) sum += q[c] * keys[j * ld + c]; return sum; };
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    Lanes<W> acc[W] = {};
    for (int r = 0; r < W; ++r)  // each key's row front to back: one stream
      for (int64_t c = 0; c < full; c += W) acc[r] += ToLanes<W>(q + c) * ToLanes<W>(keys + (j + r) * ld + c);
    Lanes<W> sums = KeySums<W>(acc);
    if (full < dim) for (int r = 0; r < W; ++r) sums[r] += tail(j + r);
    std::memcpy(scores + j, &sums, sizeof sums);
  }
  for (; j < n; ++j) {
    Lanes<W> acc = {};
    for (int64_t c = 0; c < full; c += W) acc += ToLanes<W>(q + c) * ToLanes<W>(keys + j * ld + c);
    scores[j] = SumLanes<W>(acc) + tail(j);
  }
}

// out[c] = sum over j < n of p[j] value j[c], values ld floats apart: per block of up to eight
// registers of columns (a head_dim of 64 in one), one pass over the keys front to back with the
// sums in registers (a store and reload of out per key made each key wait for the previous one;
// blocks of four read each row in two passes, 1.3x slower from memory); narrow blocks split the
// keys over chains (key j into chain j mod C, added at the end) to hide the FMA latency.
void WeightedValues(const float* p, const float* values, int64_t ld, int64_t n, int64_t dim, float* out) {
  constexpr int W = kNarrow, kUnits = 8;
  const int64_t full = dim / W;
  auto block = [&](auto units, int64_t u0) __attribute__((always_inline)) {
    constexpr int U = decltype(units)::value, C = U >= 8 ? 1 : U >= 4 ? 2 : 4;
    Lanes<W> acc[C][U] = {};
    int64_t j = 0;
    for (; j + C <= n; j += C) {
      for (int r = 0; r < C; ++r)
        for (int u = 0; u < U; ++u) acc[r][u] += p[j + r] * ToLanes<W>(values + (j + r) * ld + (u0 + u) * W);
    }
    for (; j < n; ++j)
      for (int u = 0; u < U; ++u) acc[0][u] += p[j] * ToLanes<W>(values + j * ld + (u0 + u) * W);
    for (int u = 0; u < U; ++u) {
      Lanes<W> sum = acc[0][u];
      for (int r = 1; r < C; ++r) sum += acc[r][u];
      std::memcpy(out + (u0 + u) * W, &sum, sizeof sum);
    }
  };
  int64_t u0 = 0;
  for (; u0 + kUnits <= full; u0 += kUnits) block(std::integral_constant<int, kUnits>{}, u0);
  if (full - u0 >= 4) block(std::integral_constant<int, 4>{}, u0), u0 += 4;
  if (full - u0 >= 2) block(std::integral_constant<int, 2>{}, u0), u0 += 2;
  if (full - u0 >= 1) block(std::integral_constant<int, 1>{}, u0), u0 += 1;
  for (int64_t c = full * W; c < dim; ++c) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += p[j] * values[j * ld + c];
    out[c] = sum;
  }
}

// Heads narrower than a register (head_dim 8 on AVX-512): W / M keys side by side in each register
// (a head's cache holds its keys back to back, ld = M), so no lane idles and one fold tree sums
// twice the keys (12 heads of 8 over 129 keys: 2.2 us above the op's floor, against 3.3 with the
// paths above).
// M = head_dim divides W; keys past the last full pass one at a time.
template <int M>
void PackedScores(const float* q, const float* keys, int64_t n, float* scores) {
  constexpr int W = kWide, kKeys = W / M;
  Lanes<W> qs;
  for (int l = 0; l < W; ++l) qs[l] = q[l % M];
  int64_t j = 0;
  for (; j + W <= n; j += W) {  // W keys in M registers
    Lanes<W> acc[M];
    for (int r = 0; r < M; ++r) acc[r] = qs * ToLanes<W>(keys + (j + r * kKeys) * M);
    const Lanes<W> sums = KeySums<W, M>(acc);
    std::memcpy(scores + j, &sums, sizeof sums);
  }
  for (; j < n; ++j) {
    float sum = 0.0f;
    for (int c = 0; c < M; ++c) sum += q[c] * keys[j * M + c];
    scores[j] = sum;
  }
}

// Register R of a pass: its kKeys keys' weights, each repeated over that key's M lanes.
template <int W, int M, int R, size_t... I>
inline Lanes<W> Spread(Lanes<W> p, std::index_sequence<I...>) {
  return __builtin_shufflevector(p, p, (R * (W / M) + I / M)...);
}

template <int W, int M, int C, size_t... R>
inline void WeighPass(Lanes<W> p, const float* values, Lanes<W>* acc, std::index_sequence<R...>) {
  ((acc[R % C] += Spread<W, M, R>(p, std::make_index_sequence<W>{}) * ToLanes<W>(values + R * W)), ...);
}

// out[c] = sum over j < n of p[j] value j[c], as PackedScores reads the values: W keys a pass (the
// weights of M registers from one load), into C chains; the chains and then the kKeys keys of a
// register added at the end.
template <int M>
void PackedWeightedValues(const float* p, const float* values, int64_t n, float* out) {
  constexpr int W = kWide, kKeys = W / M, C = 4;
  Lanes<W> acc[C] = {};
  int64_t j = 0;
  for (; j + W <= n; j += W) WeighPass<W, M, C>(ToLanes<W>(p + j), values + j * M, acc, std::make_index_sequence<M>{});
  const Lanes<W> sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float result[M] = {};
  for (int k = 0; k < kKeys; ++k)
    for (int c = 0; c < M; ++c) result[c] += sum[k * M + c];
  for (; j < n; ++j)
    for (int c = 0; c < M; ++c) result[c] += p[j] * values[j * M + c];
  std::memcpy(out, result, sizeof result);
}

// f(std::integral_constant<int, dim>) where dim < kWide divides kWide (a PackedScores head);
// false otherwise.
template <int M = kWide / 2, class F>
bool WithPackedHead(int64_t dim, F&& f) {
  if constexpr (M < 1) {
    return false;
  } else {
    if (dim == M) return f(std::integral_constant<int, M>{}), true;
    return WithPackedHead<M / 2>(dim, f);
  }
}

void Attention(const AttentionSizes& s, const float* qkv, const float* past_key, const float* past_value,
               const int32_t* seqlens_k, const float* bias, float* y, float* present_key, float* present_value,
               const ParallelFor& parallel_for) {
  const int64_t dim = s.head_dim, width = 3 * s.heads * dim, heads = s.batch * s.heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const auto past_of = [&](int64_t b) { return static_cast<int64_t>(seqlens_k[b]) + 1 - s.sequence; };
  const auto cache = [&](float* present, int64_t b, int64_t h) { return present + (b * s.heads + h) * s.present * dim; };
  const auto token = [&](int64_t b, int64_t i) { return qkv + (b * s.sequence + i) * width; };
  // The cache first: unless present is past's own buffer, row b's past_b positions copied and the
  // rest zeroed; then the new keys and values after them.
  const bool shared = present_key == past_key && present_value == past_value;
  const int64_t work = heads * s.sequence * (s.total + 1) * dim;
  const ParallelFor inline_for = [](size_t n, const std::function<void(size_t)>& body) {
    for (size_t i = 0; i < n; ++i) body(i);
  };
  const ParallelFor& loop = work < kAttentionInline ? inline_for : parallel_for;
  loop(static_cast<size_t>(heads), [&](size_t item) {
    const int64_t b = static_cast<int64_t>(item) / s.heads, h = static_cast<int64_t>(item) % s.heads;
    for (int which = 0; which < 2; ++which) {
      float* present = cache(which ? present_value : present_key, b, h);
      if (!shared) {
        const float* past = (which ? past_value : past_key);
        if (past_of(b)) std::memcpy(present, past + (b * s.heads + h) * s.past * dim, past_of(b) * dim * sizeof(float));
        std::fill(present + past_of(b) * dim, present + s.present * dim, 0.0f);
      }
      for (int64_t i = 0; i < s.sequence; ++i) {
        std::memcpy(present + (past_of(b) + i) * dim, token(b, i) + (1 + which) * s.heads * dim + h * dim, dim * sizeof(float));
      }
    }
  });
  // Query i of row b sees keys j < past_b + i + 1 (those after it are masked, as are none before:
  // left padding comes as bias); their scores become its weights in place.
  const auto seen = [&](int64_t b, int64_t i) { return past_of(b) + i + 1; };
  const auto weigh = [&](int64_t b, int64_t i, float* row) {
    const float* add = bias + ((s.bias_batch ? b : 0) * s.sequence + i) * s.total;
    for (int64_t j = 0; j < seen(b, i); ++j) row[j] = row[j] * scale + add[j];
    Softmax(row, seen(b, i));
  };
  if (s.sequence <= kDecodeMaxTokens) {
    // One weights row per item, rows aligned for Softmax: one allocation per call.
    const int64_t ld = (s.total + 15) / 16 * 16;
    Eigen::ArrayXf rows(heads * ld);
    loop(static_cast<size_t>(heads), [&](size_t item) {
      const int64_t b = static_cast<int64_t>(item) / s.heads, h = static_cast<int64_t>(item) % s.heads;
      float* row = rows.data() + static_cast<int64_t>(item) * ld;
      for (int64_t i = 0; i < s.sequence; ++i) {
        const float *q = token(b, i) + h * dim, *keys = cache(present_key, b, h), *values = cache(present_value, b, h);
        float* out = y + (b * s.sequence + i) * s.heads * dim + h * dim;
        const int64_t n = seen(b, i);
        const bool packed = WithPackedHead(dim, [&](auto m) {
          PackedScores<m>(q, keys, n, row);
          weigh(b, i, row);
          PackedWeightedValues<m>(row, values, n, out);
        });
        if (!packed) {
          Scores(q, keys, dim, n, dim, row);
          weigh(b, i, row);
          WeightedValues(row, values, dim, n, dim, out);
        }
      }
    });
    return;
  }
  // Prefill: per item, the scores of its queries by one Gemm, weights, and a second Gemm.
  const int64_t blocks = (s.sequence + kAttentionQueries - 1) / kAttentionQueries;
  loop(static_cast<size_t>(heads * blocks), [&](size_t item) {
    const int64_t pair = static_cast<int64_t>(item) / blocks, block = static_cast<int64_t>(item) % blocks;
    const int64_t b = pair / s.heads, h = pair % s.heads;
    const int64_t first = block * kAttentionQueries, n = std::min(kAttentionQueries, s.sequence - first);
    const int64_t keys = seen(b, first + n - 1), ld = (keys + 15) / 16 * 16;  // rows aligned for Softmax
    Eigen::ArrayXf scores(n * ld);
    Gemm<true>(PackTokens(n, dim, [&](int64_t t) { return token(b, first + t) + h * dim; }), n, dim,
               cache(present_key, b, h), dim, keys, scores.data(), ld);
    for (int64_t t = 0; t < n; ++t) {
      float* row = scores.data() + t * ld;
      weigh(b, first + t, row);
      std::fill(row + seen(b, first + t), row + keys, 0.0f);
    }
    Gemm<false>(PackTokens(n, keys, [&](int64_t t) { return scores.data() + t * ld; }), n, keys,
                cache(present_value, b, h), dim, dim, y + (b * s.sequence + first) * s.heads * dim + h * dim,
                s.heads * dim);
  });
}

}  // namespace

// Float rows; at decode on Intel's cores streamed as IntelStreams() says.
template <typename T>
void Run(const Sizes& s, const T* x, const int64_t* starts, const T* w_in, const T* b_in,
         const T* w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  if (IntelStreams() && s.tokens > 0 && s.tokens <= kDecodeMaxTokens) {
    Decode(s, x, starts, FloatRows<T, true>{w_in, s.d}, b_in, FloatRows<T, true>{w_out, s.d}, b_out, y, parallel_for);
  } else {
    Compute(s, x, starts, FloatRows<T>{w_in, s.d}, b_in, FloatRows<T>{w_out, s.d}, b_out, y, parallel_for);
  }
}

template <typename T>
void RunQuantized(const Sizes& s, const Quantization& q, const T* x, const int64_t* starts,
                  const QuantizedMatrix<T>& w_in, const T* b_in, const QuantizedMatrix<T>& w_out,
                  const T* b_out, T* y, const ParallelFor& parallel_for) {
  if (q.bits == 8) {
    Compute(s, x, starts, QuantRows<8, T>(w_in, s.d, q.block_size), b_in, QuantRows<8, T>(w_out, s.d, q.block_size),
            b_out, y, parallel_for);
  } else {
    Compute(s, x, starts, QuantRows<4, T>(w_in, s.d, q.block_size), b_in, QuantRows<4, T>(w_out, s.d, q.block_size),
            b_out, y, parallel_for);
  }
}

template <typename T>
void RunQMatMul(const MatMulSizes& s, const Quantization& q, const T* x, const QuantizedMatrix<T>& w, T* y,
                const ParallelFor& parallel_for) {
  const int64_t stride = (s.k + q.block_size - 1) / q.block_size * q.block_size * q.bits / 8;  // whole blocks
  if (q.bits == 8) {
    ComputeMatMul(s, x, QuantRows<8, T>(w, s.k, q.block_size, stride), y, parallel_for);
  } else {
    ComputeMatMul(s, x, QuantRows<4, T>(w, s.k, q.block_size, stride), y, parallel_for);
  }
}

void RunAttention(const AttentionSizes& s, const float* qkv, const float* past_key, const float* past_value,
                  const int32_t* seqlens_k, const float* bias, const float* qkv_bias, float* y, float* present_key,
                  float* present_value, const ParallelFor& parallel_for) {
  // The bias added once, into a copy (as its own Add node would: the same bits); a decode step's
  // qkv is a few KB, a prefill's one pass more than the attention's own.
  std::vector<float> biased;
  if (qkv_bias) {
    const int64_t width = 3 * s.heads * s.head_dim;
    biased.assign(qkv, qkv + s.batch * s.sequence * width);
    for (int64_t t = 0; t < s.batch * s.sequence; ++t)
      for (int64_t c = 0; c < width; ++c) biased[t * width + c] += qkv_bias[c];
    qkv = biased.data();
  }
  Attention(s, qkv, past_key, past_value, seqlens_k, bias, y, present_key, present_value, parallel_for);
}

#define INFMOE_INSTANTIATE(T)                                                                               \
  template void Run<T>(const Sizes&, const T*, const int64_t*, const T*, const T*, const T*, const T*, T*, \
                       const ParallelFor&);                                                                \
  template void RunQuantized<T>(const Sizes&, const Quantization&, const T*, const int64_t*,               \
                                const QuantizedMatrix<T>&, const T*, const QuantizedMatrix<T>&, const T*,  \
                                T*, const ParallelFor&);                                                 \
  template void RunQMatMul<T>(const MatMulSizes&, const Quantization&, const T*, const QuantizedMatrix<T>&, T*, \
                              const ParallelFor&);
INFMOE_INSTANTIATE(float)
INFMOE_INSTANTIATE(uint16_t)
#undef INFMOE_INSTANTIATE

}  // namespace INFMOE_VARIANT
}  // namespace infmoe
