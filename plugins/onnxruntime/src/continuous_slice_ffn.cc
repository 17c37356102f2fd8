// Two paths, both touching only the union of the windows:
//  * decode (few tokens): per token, the rows its windows cover are cut into fixed chunks; each
//    chunk computes its hidden units and a partial output (two GEMVs), partials are summed in
//    chunk order. Parallel over chunks, so one token uses every thread; memory bound.
//  * prefill (many tokens): tokens sorted by window position and grouped; per group, blocked
//    GEMMs (Eigen) over the row ranges any of its tokens cover, weighted by coverage, split over
//    fixed blocks of hidden units whose partial outputs are summed in block order.
// Work is split by token and by fixed row chunks, never by thread, so the summation order (and
// so every bit of the result) is the same for any number of threads.
//
// This file is compiled once per CPU variant (CMakeLists.txt: baseline, and on x86-64 also
// -march=x86-64-v3 and -march=x86-64-v4), each copy in its own namespace infmoe::INFMOE_VARIANT;
// dispatch.cc picks one at run time. Why the copies cannot leak into each other: see CMakeLists.txt.
#include "continuous_slice_ffn.h"

#include <Eigen/Core>
#include <algorithm>
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

constexpr int64_t kDecodeMaxTokens = 3;  // up to this many tokens: the decode path
constexpr int64_t kChunkRows = 64;       // decode: rows per work item
constexpr int64_t kGroupTokens = 128;    // prefill: tokens per GEMM group
constexpr int64_t kHiddenBlock = 512;    // prefill: hidden units per work item
constexpr int64_t kMergeGap = 32;        // prefill: fill uncovered gaps shorter than this

// Element access: float is used in place, half (uint16_t bits) is converted to float.
inline Eigen::Map<const Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>
HalfView(const uint16_t* p, Index rows, Index cols) {
  return {reinterpret_cast<const Eigen::half*>(p), rows, cols};
}

// Rows [lo, hi) of a [h, d] matrix as float: a view of float data, or a converted copy in scratch.
MatrixView Rows(const float* w, int64_t lo, int64_t hi, int64_t d, RowMatrix&) {
  return {w + lo * d, hi - lo, d};
}
MatrixView Rows(const uint16_t* w, int64_t lo, int64_t hi, int64_t d, RowMatrix& scratch) {
  scratch = HalfView(w + lo * d, hi - lo, d).cast<float>();
  return {scratch.data(), hi - lo, d};
}

Vector ToFloat(const float* v, int64_t n) { return Eigen::Map<const Vector>(v, n); }
Vector ToFloat(const uint16_t* v, int64_t n) { return HalfView(v, n, 1).cast<float>(); }

void Store(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
void Store(const float* src, int64_t n, uint16_t* dst) {
  Eigen::Map<Eigen::Matrix<Eigen::half, Eigen::Dynamic, 1>>(reinterpret_cast<Eigen::half*>(dst), n) =
      Eigen::Map<const Vector>(src, n).cast<Eigen::half>();
}

// GPT-2's tanh GELU, in place, vectorised by Eigen.
template <typename ArrayLike>
void GeluTanh(ArrayLike&& a) {
  const float sqrt_2_over_pi = 0.7978845608028654f;
  a = 0.5f * a * (1.0f + (sqrt_2_over_pi * (a + 0.044715f * a.cube())).tanh());
}

// coverage[i] = (number of windows [s, s + r) covering unit i) / k, for i in [0, h).
// Form (docs/spec.md §6.3): a difference array (+1 at each start, -1 one past its end) whose
// running sum is the exact count n_i, then n_i * (1/k): equal to n_i / k up to the last bit.
void Coverage(const int64_t* starts, int64_t k, int64_t r, int64_t h, float* coverage) {
  std::vector<int32_t> depth(h + 1, 0);
  for (int64_t j = 0; j < k; ++j) {
    depth[starts[j]] += 1;
    depth[starts[j] + r] -= 1;
  }
  const float per_window = 1.0f / static_cast<float>(k);
  int32_t running = 0;
  for (int64_t i = 0; i < h; ++i) {
    running += depth[i];
    coverage[i] = static_cast<float>(running) * per_window;
  }
}

struct Range {
  int64_t lo, hi;
};

// Maximal runs of covered units, joining runs separated by fewer than `gap` uncovered units.
std::vector<Range> CoveredRanges(const std::vector<bool>& covered, int64_t gap) {
  std::vector<Range> ranges;
  const int64_t h = static_cast<int64_t>(covered.size());
  for (int64_t i = 0; i < h;) {
    if (!covered[i]) {
      ++i;
      continue;
    }
    int64_t end = i;
    while (end < h && covered[end]) ++end;
    if (!ranges.empty() && i - ranges.back().hi < gap) {
      ranges.back().hi = end;
    } else {
      ranges.push_back({i, end});
    }
    i = end;
  }
  return ranges;
}

template <typename T>
void Decode(const Sizes& s, const T* x, const int64_t* starts, const T* w_in, const T* b_in,
            const T* w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  struct Chunk {
    int64_t token, lo, hi;
  };
  std::vector<float> coverage(s.tokens * s.h);
  std::vector<Chunk> chunks;
  std::vector<size_t> first_chunk(s.tokens + 1, 0);
  for (int64_t t = 0; t < s.tokens; ++t) {
    float* c = &coverage[t * s.h];
    Coverage(starts + t * s.k, s.k, s.r, s.h, c);
    std::vector<bool> covered(s.h);
    for (int64_t i = 0; i < s.h; ++i) covered[i] = c[i] > 0.0f;
    for (const Range& range : CoveredRanges(covered, 1)) {
      for (int64_t lo = range.lo; lo < range.hi; lo += kChunkRows) {
        chunks.push_back({t, lo, std::min(lo + kChunkRows, range.hi)});
      }
    }
    first_chunk[t + 1] = chunks.size();
  }

  std::vector<Vector> xs;
  for (int64_t t = 0; t < s.tokens; ++t) xs.push_back(ToFloat(x + t * s.d, s.d));
  const Vector bias_in = ToFloat(b_in, s.h);
  RowMatrix partials(static_cast<Index>(chunks.size()), s.d);
  parallel_for(chunks.size(), [&](size_t index) {
    const Chunk& chunk = chunks[index];
    const int64_t rows = chunk.hi - chunk.lo;
    RowMatrix scratch_in, scratch_out;
    const MatrixView win = Rows(w_in, chunk.lo, chunk.hi, s.d, scratch_in);
    Vector hidden = win * xs[chunk.token] + bias_in.segment(chunk.lo, rows);
    GeluTanh(hidden.array());
    hidden.array() *= Eigen::Map<const Eigen::ArrayXf>(&coverage[chunk.token * s.h + chunk.lo], rows);
    const MatrixView wout = Rows(w_out, chunk.lo, chunk.hi, s.d, scratch_out);
    partials.row(static_cast<Index>(index)).noalias() = hidden.transpose() * wout;
  });

  const Vector bias_out = ToFloat(b_out, s.d);
  for (int64_t t = 0; t < s.tokens; ++t) {
    Eigen::RowVectorXf out = bias_out.transpose();
    for (size_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) out += partials.row(static_cast<Index>(c));
    Store(out.data(), s.d, y + t * s.d);
  }
}

template <typename T>
void Prefill(const Sizes& s, const T* x, const int64_t* starts, const T* w_in, const T* b_in,
             const T* w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  // Tokens whose windows start close together share a group, so its span stays narrow.
  std::vector<int64_t> order(s.tokens);
  std::iota(order.begin(), order.end(), 0);
  std::vector<int64_t> first(s.tokens);
  for (int64_t t = 0; t < s.tokens; ++t) first[t] = *std::min_element(starts + t * s.k, starts + (t + 1) * s.k);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return first[a] < first[b]; });

  const Vector bias_in = ToFloat(b_in, s.h);
  const Vector bias_out = ToFloat(b_out, s.d);
  RowMatrix xg, coverage, yg, partials;
  for (int64_t begin = 0; begin < s.tokens; begin += kGroupTokens) {
    const int64_t n = std::min(kGroupTokens, s.tokens - begin);
    xg.resize(n, s.d);
    coverage.resize(n, s.h);
    std::vector<bool> covered(s.h, false);
    for (int64_t g = 0; g < n; ++g) {
      const int64_t t = order[begin + g];
      xg.row(g) = ToFloat(x + t * s.d, s.d).transpose();
      Coverage(starts + t * s.k, s.k, s.r, s.h, coverage.row(g).data());
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t lo = starts[t * s.k + j];
        std::fill(covered.begin() + lo, covered.begin() + lo + s.r, true);
      }
    }
    yg = bias_out.transpose().replicate(n, 1);
    for (const Range& range : CoveredRanges(covered, kMergeGap)) {
      // One work item per block of hidden units: GEMM, bias, GELU, coverage, then the block's
      // partial output (a second GEMM); partials are added in block order afterwards.
      const int64_t rows = range.hi - range.lo;
      const int64_t blocks = (rows + kHiddenBlock - 1) / kHiddenBlock;
      partials.resize(blocks * n, s.d);
      parallel_for(static_cast<size_t>(blocks), [&](size_t block) {
        const int64_t lo = range.lo + static_cast<int64_t>(block) * kHiddenBlock;
        const int64_t hi = std::min(lo + kHiddenBlock, range.hi);
        RowMatrix scratch, hidden;
        hidden.noalias() = xg * Rows(w_in, lo, hi, s.d, scratch).transpose();
        hidden.rowwise() += bias_in.segment(lo, hi - lo).transpose();
        GeluTanh(hidden.array());
        hidden.array() *= coverage.middleCols(lo, hi - lo).array();
        partials.middleRows(static_cast<Index>(block) * n, n).noalias() = hidden * Rows(w_out, lo, hi, s.d, scratch);
      });
      for (int64_t block = 0; block < blocks; ++block) yg += partials.middleRows(block * n, n);
    }
    for (int64_t g = 0; g < n; ++g) Store(yg.row(g).data(), s.d, y + order[begin + g] * s.d);
  }
}

}  // namespace

template <typename T>
void Run(const Sizes& s, const T* x, const int64_t* starts, const T* w_in, const T* b_in,
         const T* w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  if (s.tokens == 0) return;
  if (s.tokens <= kDecodeMaxTokens) {
    Decode(s, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
  } else {
    Prefill(s, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
  }
}

template void Run<float>(const Sizes&, const float*, const int64_t*, const float*, const float*,
                         const float*, const float*, float*, const ParallelFor&);
template void Run<uint16_t>(const Sizes&, const uint16_t*, const int64_t*, const uint16_t*,
                            const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                            const ParallelFor&);

}  // namespace INFMOE_VARIANT
}  // namespace infmoe
