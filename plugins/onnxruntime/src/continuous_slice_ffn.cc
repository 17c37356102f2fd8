// Both ops, float and quantized (SPEC §4, §6), share one computation over a weight format: a
// format hands out 16 columns of a row as float (FloatRows: float or half; QuantRows: 8- or 4-bit
// integers times their block scale, w' = q * scale exactly as the reference dequantizes).
// Two paths, both touching only the union of the windows:
//  * decode (few tokens): per token, the rows its windows cover are cut into fixed chunks; each
//    chunk reads its w_in rows once (dot products, four rows at a time), applies bias, GELU and
//    coverage, then reads its w_out rows once (the partial output, four rows at a time); partials
//    are summed in chunk order. Parallel over chunks, so one token uses every thread; memory
//    bound, so the inner loops work on whole registers of 16 floats and nothing is converted or
//    copied outside them.
//  * prefill (many tokens): tokens sorted by window position and grouped; per group, blocked
//    GEMMs (Eigen) over the row ranges any of its tokens cover, weighted by coverage, split over
//    fixed blocks of hidden units whose partial outputs are summed in block order. A block of
//    half or quantized rows is first converted into float scratch that stays in cache.
// Work is split by token and by fixed row chunks, never by thread, so the summation order (and
// so every bit of the result) is the same for any number of threads.
//
// This file is compiled once per CPU variant (CMakeLists.txt: baseline, and on x86-64 also
// -march=x86-64-v3 and -march=x86-64-v4), each copy in its own namespace infmoe::INFMOE_VARIANT;
// dispatch.cc picks one at run time. Why the copies cannot leak into each other: see CMakeLists.txt.
#include "continuous_slice_ffn.h"

#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#ifndef INFMOE_VARIANT
#error "compile with -DINFMOE_VARIANT=<name> (see CMakeLists.txt)"
#endif

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

using Index = Eigen::Index;
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixView = Eigen::Map<const RowMatrix>;
using Vector = Eigen::VectorXf;

// 16 floats as a GCC/Clang vector: one AVX-512 register, two AVX2 or four SSE2 / NEON registers,
// whichever the variant is compiled for.
constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(64)));
typedef uint8_t Bytes __attribute__((vector_size(16)));

constexpr int64_t kDecodeMaxTokens = 3;    // up to this many tokens: the decode path
constexpr int64_t kChunkBytes = 256 << 10;  // decode: weight bytes (w_in + w_out) per work item
constexpr int64_t kMaxChunkRows = 1024;
constexpr int64_t kGroupTokens = 128;      // prefill: tokens per GEMM group
constexpr int64_t kHiddenBlock = 512;      // prefill: hidden units per work item
constexpr int64_t kMergeGap = 32;          // prefill: fill uncovered gaps shorter than this

inline float ToFloat(float v) { return v; }
inline float ToFloat(uint16_t v) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(v)); }
inline void FromFloat(float v, float* dst) { *dst = v; }
inline void FromFloat(float v, uint16_t* dst) { *dst = Eigen::numext::bit_cast<uint16_t>(Eigen::half(v)); }

// Columns [16u, 16u + n) of `row` as Lanes, zero beyond n. n is kLanes except in a row's last,
// partial unit; callers pass the constant kLanes in their main loop so the check folds away.
template <typename T>
inline Lanes LoadLanes(const T* row, int64_t u, int64_t n) {
  Lanes v = {};
  if (std::is_same<T, float>::value && n == kLanes) {
    std::memcpy(&v, row + u * kLanes, sizeof v);
  } else {
    for (int64_t l = 0; l < n; ++l) v[l] = ToFloat(row[u * kLanes + l]);
  }
  return v;
}

// A float [h, d] matrix (T = float, or half as uint16_t bits).
template <typename T>
struct FloatRows {
  using Row = const T*;
  const T* w;
  int64_t d;
  Row At(int64_t i) const { return w + i * d; }
  Lanes Unit(Row row, int64_t u, int64_t n) const { return LoadLanes(row, u, n); }
  int64_t RowBytes() const { return d * static_cast<int64_t>(sizeof(T)); }
};

// A quantized [h, d] matrix (SPEC §6): unsigned storage with offset 2^(bits-1), int4 two columns
// per byte (even column in the low nibble), one scale per block of 2^block_shift units.
template <int Bits, typename T>
struct QuantRows {
  struct Row {
    const uint8_t* q;
    const T* scale;
  };
  const uint8_t* q;
  const T* scale;
  int64_t d, packed, blocks;
  int block_shift;  // log2(block_size / kLanes): a unit never straddles two blocks (B >= 16, a power of two)

  QuantRows(const QuantizedMatrix<T>& m, int64_t d_, int64_t block_size)
      : q(m.packed), scale(m.scale), d(d_), packed(Bits == 8 ? d_ : (d_ + 1) / 2),
        blocks((d_ + block_size - 1) / block_size), block_shift(0) {
    while ((kLanes << block_shift) < block_size) ++block_shift;
  }
  Row At(int64_t i) const { return {q + i * packed, scale + i * blocks}; }
  Lanes Unit(Row row, int64_t u, int64_t n) const {
    constexpr int64_t kBytes = kLanes * Bits / 8;  // bytes per unit
    constexpr uint8_t kPad = Bits == 8 ? 128 : 0x88;  // stored zeros
    Bytes b;
    std::memset(&b, kPad, sizeof b);
    std::memcpy(&b, row.q + u * kBytes, n == kLanes ? kBytes : (n * Bits + 7) / 8);
    if (Bits == 4) {
      // Bytes 0-7 hold columns (0, 1) .. (14, 15): interleave low and high nibbles into column order.
      const Bytes low = b & 15, high = b >> 4;
      b = __builtin_shuffle(low, high, Bytes{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23});
    }
    const Lanes values = __builtin_convertvector(b, Lanes) - static_cast<float>(1 << (Bits - 1));
    return values * ToFloat(row.scale[u >> block_shift]);
  }
  int64_t RowBytes() const { return packed + blocks * static_cast<int64_t>(sizeof(T)); }
};

// Sum of the lanes in a fixed order (halves, then quarters, ...).
inline float SumLanes(Lanes v) {
  float s[kLanes];
  std::memcpy(s, &v, sizeof s);
  for (int64_t width = kLanes / 2; width >= 1; width /= 2) {
    for (int64_t l = 0; l < width; ++l) s[l] += s[l + width];
  }
  return s[0];
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

// The runs of units covered by a token's windows, merged across gaps shorter than `gap`, in order.
void AddWindows(const int64_t* starts, int64_t k, int64_t r, std::vector<Range>& windows) {
  for (int64_t j = 0; j < k; ++j) windows.push_back({starts[j], starts[j] + r});
}
std::vector<Range> Merged(std::vector<Range> windows, int64_t gap) {
  std::sort(windows.begin(), windows.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  std::vector<Range> runs;
  for (const Range& w : windows) {
    if (!runs.empty() && w.lo - runs.back().hi < gap) {
      runs.back().hi = std::max(runs.back().hi, w.hi);
    } else {
      runs.push_back(w);
    }
  }
  return runs;
}

// ---- decode -------------------------------------------------------------------------------------

// dot[g] = row (i + g) . x for g < G: G rows at once, so each x unit is loaded once per G rows
// and G accumulator chains hide the FMA latency.
template <int G, class Format>
inline void Dots(const Format& w, int64_t i, const Lanes* x, int64_t full, int64_t tail, float* dot) {
  typename Format::Row rows[G];
  Lanes acc[G];
  for (int g = 0; g < G; ++g) rows[g] = w.At(i + g), acc[g] = Lanes{};
  for (int64_t u = 0; u < full; ++u) {
    for (int g = 0; g < G; ++g) acc[g] += w.Unit(rows[g], u, kLanes) * x[u];
  }
  if (tail) {
    for (int g = 0; g < G; ++g) acc[g] += w.Unit(rows[g], full, tail) * x[full];
  }
  for (int g = 0; g < G; ++g) dot[g] = SumLanes(acc[g]);
}

// out += sum over g < G of h[g] * row (i + g), added in g order.
template <int G, class Format>
inline void Axpys(const Format& w, int64_t i, const float* h, int64_t full, int64_t tail, Lanes* out) {
  typename Format::Row rows[G];
  for (int g = 0; g < G; ++g) rows[g] = w.At(i + g);
  for (int64_t u = 0; u < full; ++u) {
    Lanes o = out[u];
    for (int g = 0; g < G; ++g) o += h[g] * w.Unit(rows[g], u, kLanes);
    out[u] = o;
  }
  if (tail) {
    Lanes o = out[full];
    for (int g = 0; g < G; ++g) o += h[g] * w.Unit(rows[g], full, tail);
    out[full] = o;
  }
}

template <typename T, class Format>
void Decode(const Sizes& s, const T* x, const int64_t* starts, const Format& w_in, const T* b_in,
            const Format& w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  const int64_t full = s.d / kLanes, tail = s.d % kLanes, units = full + (tail ? 1 : 0);
  // Chunks of a fixed number of rows (from the format's row size, never from the thread count).
  const int64_t chunk_rows =
      std::clamp<int64_t>(kChunkBytes / (w_in.RowBytes() + w_out.RowBytes()) / 4 * 4, 4, kMaxChunkRows);
  struct Chunk {
    int64_t token, lo, hi;
  };
  std::vector<Chunk> chunks;
  std::vector<size_t> first_chunk(s.tokens + 1, 0);
  std::vector<Lanes> xs(s.tokens * units);
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<Range> windows;
    AddWindows(starts + t * s.k, s.k, s.r, windows);
    for (const Range& run : Merged(std::move(windows), 1)) {
      for (int64_t lo = run.lo; lo < run.hi; lo += chunk_rows) chunks.push_back({t, lo, std::min(lo + chunk_rows, run.hi)});
    }
    first_chunk[t + 1] = chunks.size();
    for (int64_t u = 0; u < units; ++u) xs[t * units + u] = LoadLanes(x + t * s.d, u, u < full ? kLanes : tail);
  }

  std::vector<Lanes> partials(chunks.size() * units);
  parallel_for(chunks.size(), [&](size_t index) {
    const Chunk& c = chunks[index];
    const Lanes* xt = &xs[c.token * units];
    Lanes* out = &partials[index * units];
    float hidden[kMaxChunkRows], coverage[kMaxChunkRows];
    const int64_t rows = c.hi - c.lo, grouped = rows / 4 * 4;
    for (int64_t i = 0; i < grouped; i += 4) Dots<4>(w_in, c.lo + i, xt, full, tail, hidden + i);
    for (int64_t i = grouped; i < rows; ++i) Dots<1>(w_in, c.lo + i, xt, full, tail, hidden + i);
    for (int64_t i = 0; i < rows; ++i) hidden[i] += ToFloat(b_in[c.lo + i]);
    Eigen::Map<Eigen::ArrayXf> h(hidden, rows);
    GeluTanh(h);
    Coverage(starts + c.token * s.k, s.k, s.r, c.lo, c.hi, coverage);
    h *= Eigen::Map<const Eigen::ArrayXf>(coverage, rows);
    std::fill(out, out + units, Lanes{});
    for (int64_t i = 0; i < grouped; i += 4) Axpys<4>(w_out, c.lo + i, hidden + i, full, tail, out);
    for (int64_t i = grouped; i < rows; ++i) Axpys<1>(w_out, c.lo + i, hidden + i, full, tail, out);
  });

  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t u = 0; u < units; ++u) {
      const int64_t n = u < full ? kLanes : tail;
      Lanes sum = LoadLanes(b_out, u, n);
      for (size_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) sum += partials[c * units + u];
      for (int64_t l = 0; l < n; ++l) FromFloat(sum[l], y + t * s.d + u * kLanes + l);
    }
  }
}

// ---- prefill ------------------------------------------------------------------------------------

// Rows [lo, hi) as a float matrix: a view of float data, or converted into scratch.
MatrixView Rows(const FloatRows<float>& w, int64_t lo, int64_t hi, RowMatrix&) {
  return {w.w + lo * w.d, hi - lo, w.d};
}
template <class Format>
MatrixView Rows(const Format& w, int64_t lo, int64_t hi, RowMatrix& scratch) {
  scratch.resize(hi - lo, w.d);
  const int64_t units = (w.d + kLanes - 1) / kLanes;
  for (int64_t i = lo; i < hi; ++i) {
    const typename Format::Row row = w.At(i);
    float* dst = scratch.row(i - lo).data();
    for (int64_t u = 0; u < units; ++u) {
      const int64_t n = std::min(kLanes, w.d - u * kLanes);
      const Lanes v = w.Unit(row, u, n);
      std::memcpy(dst + u * kLanes, &v, n * sizeof(float));
    }
  }
  return {scratch.data(), hi - lo, w.d};
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
  RowMatrix xg, coverage, yg, partials;
  for (int64_t begin = 0; begin < s.tokens; begin += kGroupTokens) {
    const int64_t n = std::min(kGroupTokens, s.tokens - begin);
    xg.resize(n, s.d);
    coverage.resize(n, s.h);
    std::vector<Range> windows;
    for (int64_t g = 0; g < n; ++g) {
      const int64_t t = order[begin + g];
      xg.row(g) = ToVector(x + t * s.d, s.d).transpose();
      Coverage(starts + t * s.k, s.k, s.r, 0, s.h, coverage.row(g).data());
      AddWindows(starts + t * s.k, s.k, s.r, windows);
    }
    yg = bias_out.transpose().replicate(n, 1);
    for (const Range& range : Merged(std::move(windows), kMergeGap)) {
      // One work item per block of hidden units: GEMM, bias, GELU, coverage, then the block's
      // partial output (a second GEMM); partials are added in block order afterwards.
      const int64_t rows = range.hi - range.lo;
      const int64_t blocks = (rows + kHiddenBlock - 1) / kHiddenBlock;
      partials.resize(blocks * n, s.d);
      parallel_for(static_cast<size_t>(blocks), [&](size_t block) {
        const int64_t lo = range.lo + static_cast<int64_t>(block) * kHiddenBlock;
        const int64_t hi = std::min(lo + kHiddenBlock, range.hi);
        RowMatrix scratch, hidden;
        hidden.noalias() = xg * Rows(w_in, lo, hi, scratch).transpose();
        hidden.rowwise() += bias_in.segment(lo, hi - lo).transpose();
        GeluTanh(hidden.array());
        hidden.array() *= coverage.middleCols(lo, hi - lo).array();
        partials.middleRows(static_cast<Index>(block) * n, n).noalias() = hidden * Rows(w_out, lo, hi, scratch);
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

}  // namespace

template <typename T>
void Run(const Sizes& s, const T* x, const int64_t* starts, const T* w_in, const T* b_in,
         const T* w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  Compute(s, x, starts, FloatRows<T>{w_in, s.d}, b_in, FloatRows<T>{w_out, s.d}, b_out, y, parallel_for);
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

#define INFMOE_INSTANTIATE(T)                                                                               \
  template void Run<T>(const Sizes&, const T*, const int64_t*, const T*, const T*, const T*, const T*, T*, \
                       const ParallelFor&);                                                                \
  template void RunQuantized<T>(const Sizes&, const Quantization&, const T*, const int64_t*,               \
                                const QuantizedMatrix<T>&, const T*, const QuantizedMatrix<T>&, const T*,  \
                                T*, const ParallelFor&);
INFMOE_INSTANTIATE(float)
INFMOE_INSTANTIATE(uint16_t)
#undef INFMOE_INSTANTIATE

}  // namespace INFMOE_VARIANT
}  // namespace infmoe
