// The CPU computation of infmoe::QMatMul: the expert ops' paths (GEMV, batched, prefill GEMM;
// common/paths.h chooses) over every row of a dense quantized matrix, with nothing after the dot
// products. Compiled once per CPU variant.
#include "common/variant.h"
#include "common/batched.h"
#include "common/gemm.h"
#include "common/int8_dots.h"
#include "common/paths.h"
#include "common/weight_formats.h"
#include "ops/qmatmul/qmatmul.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

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
    thread_local std::vector<float> dots;
    dots.resize(s.tokens * rows);
    DotChunks(w, lo, hi - lo, xs.data(), s.tokens, units, s.k / W, s.k % W, dots.data(), rows);
    for (int64_t t = 0; t < s.tokens; ++t)
      for (int64_t j = lo; j < hi; ++j) FromFloat(dots[t * rows + j - lo], y + t * s.n + j);
  });
}

// Many tokens: per work item of kMatMulRows rows, dequantized once into scratch, one Gemm.
template <typename T, class Format>
void PrefillMatMul(const MatMulSizes& s, const T* x, const Format& w, T* y, const ParallelFor& parallel_for) {
  const std::vector<float> packed = PackTokens(s.tokens, s.k, [&](int64_t t) { return x + t * s.k; });
  parallel_for(static_cast<size_t>((s.n + kMatMulRows - 1) / kMatMulRows), [&](size_t item) {
    const int64_t lo = static_cast<int64_t>(item) * kMatMulRows, rows = std::min(kMatMulRows, s.n - lo);
    RowMatrix scratch;
    Gemm<true>(TilesOf(packed, s.k), s.tokens, s.k, Rows(w, lo, lo + rows, scratch), s.k, rows, y + lo, s.n);
  });
}

// A few to a few dozen tokens: per work item of kBlockRows rows, converted once into floats,
// every token's dots (common/batched.h).
template <typename T, class Format>
void BatchedMatMul(const MatMulSizes& s, const T* x, const Format& w, T* y, const ParallelFor& parallel_for) {
  const std::vector<float> xs = PaddedTokens(x, s.tokens, s.k);
  const int64_t depth = PaddedDepth(s.k);
  std::vector<const float*> rows_of(s.tokens);
  for (int64_t t = 0; t < s.tokens; ++t) rows_of[t] = xs.data() + t * depth;
  parallel_for(static_cast<size_t>((s.n + kBlockRows - 1) / kBlockRows), [&](size_t item) {
    const int64_t lo = static_cast<int64_t>(item) * kBlockRows, hi = std::min(lo + kBlockRows, s.n);
    thread_local std::vector<float> scratch, dots;
    int64_t ld = 0;
    const float* block = FloatBlock(w, lo, hi, scratch, &ld);
    dots.resize(s.tokens * kBlockRows);
    Dots(rows_of.data(), s.tokens, block, ld, hi - lo, depth, dots.data(), kBlockRows);
    for (int64_t t = 0; t < s.tokens; ++t)
      for (int64_t j = lo; j < hi; ++j) FromFloat(dots[t * kBlockRows + j - lo], y + t * s.n + j);
  });
}

// int8 activations on the integer dots: per work item a range of rows, every token's dots. As
// many rows as decode's chunks (few tokens: a work item's overhead is paid per chunk, not per 32
// rows), fewer as the tokens grow (the item's dots stay within kIntDotsBytes), whole tiles of rows
// (a multiple of the register blocks of few tokens' int8 dots too).
constexpr int64_t kIntDotsBytes = 256 << 10;
template <int Bits, typename T>
void IntMatMul(const MatMulSizes& s, const QuantizedTokens& xs, const QuantRows<Bits, T>& w, int64_t block_size, T* y,
               const ParallelFor& parallel_for) {
  std::vector<int64_t> ids(s.tokens);
  std::iota(ids.begin(), ids.end(), 0);
  const int64_t most = std::min({kChunkBytes / w.RowBytes(), (s.n + kMatMulItems - 1) / kMatMulItems,
                                 kIntDotsBytes / (s.tokens * static_cast<int64_t>(sizeof(float)))});
  const int64_t tile = kIntTileRows;
  const int64_t rows = std::clamp<int64_t>(most / tile * tile, tile, kMaxChunkRows);
  parallel_for(static_cast<size_t>((s.n + rows - 1) / rows), [&](size_t item) {
    const int64_t lo = static_cast<int64_t>(item) * rows, hi = std::min(lo + rows, s.n);
    thread_local std::vector<float> dots;
    dots.resize(s.tokens * rows);
    IntDots(xs, ids.data(), s.tokens, w, block_size, lo, hi - lo, dots.data(), rows);
    for (int64_t t = 0; t < s.tokens; ++t)
      for (int64_t j = lo; j < hi; ++j) FromFloat(dots[t * rows + j - lo], y + t * s.n + j);
  });
}

// One call on `path`; with int8 activations (`xs` not null) the float paths multiply them
// dequantized, the same products in float.
template <int Bits, typename T>
void ComputeMatMul(const MatMulSizes& s, const T* x, const QuantizedTokens* xs, const QuantRows<Bits, T>& w,
                   int64_t block_size, T* y, const ParallelFor& parallel_for, Path path) {
  if (s.tokens == 0 || s.n == 0) return;
  if (xs && path != Path::kInteger) {
    const std::vector<T> dequantized = xs->Dequantized<T>(s.tokens, s.k);
    return ComputeMatMul<Bits, T>(s, dequantized.data(), nullptr, w, block_size, y, parallel_for, path);
  }
  switch (path) {
    case Path::kInteger: return IntMatMul(s, *xs, w, block_size, y, parallel_for);
    case Path::kGemv: return DecodeMatMul(s, x, w, y, parallel_for);
    case Path::kBatched: return BatchedMatMul(s, x, w, y, parallel_for);
    case Path::kPrefill: return PrefillMatMul(s, x, w, y, parallel_for);
  }
}

// The path for this call (common/paths.h), timed once per process, format and kind of
// activations, grid point by grid point as calls reach them, on rows of the call's matrix.
template <int Bits, typename T, bool kInt8>
Path MatMulPath(const MatMulSizes& s, const QuantRows<Bits, T>& w, int64_t block_size) {
  static PathTiming timing;
  return timing.For(s.tokens, [&](PathChoice& choice, int end) {
    const int64_t most = std::min(CalibrationTokens(std::max(s.k, std::min<int64_t>(s.n, 4 * kBlockRows))),
                                  kPathGrid[end - 1]);
    const MatMulSizes part{0, s.k, std::min<int64_t>(s.n, 4 * kBlockRows)};
    std::vector<T> x(most * s.k), y(most * part.n);
    for (size_t i = 0; i < x.size(); ++i) FromFloat(static_cast<float>(i % 7) * 0.25f - 0.75f, &x[i]);
    MeasurePaths(choice, end, [&](Path path, int64_t tokens) {
      MatMulSizes sizes = part;
      sizes.tokens = tokens;
      if (kInt8) {
        const QuantizedTokens xs(x.data(), tokens, s.k, Bits);
        ComputeMatMul(sizes, x.data(), &xs, w, block_size, y.data(), InlineFor(), path);
      } else {
        ComputeMatMul(sizes, x.data(), nullptr, w, block_size, y.data(), InlineFor(), path);
      }
    }, [](Path path, int64_t) { return kInt8 || path != Path::kInteger; }, most);
  });
}

template <int Bits, typename T>
void RunBits(const MatMulSizes& s, const Quantization& q, const T* x, const QuantizedMatrix<T>& w, T* y,
             const ParallelFor& parallel_for) {
  const int64_t stride = (s.k + q.block_size - 1) / q.block_size * q.block_size * Bits / 8;  // whole blocks
  const QuantRows<Bits, T> rows(w, s.k, q.block_size, stride);
  if (q.int8_activations && q.block_size % kGroup == 0) {
    const QuantizedTokens xs(x, s.tokens, s.k, Bits);
    ComputeMatMul(s, x, &xs, rows, q.block_size, y, parallel_for, MatMulPath<Bits, T, true>(s, rows, q.block_size));
  } else {
    ComputeMatMul(s, x, nullptr, rows, q.block_size, y, parallel_for, MatMulPath<Bits, T, false>(s, rows, q.block_size));
  }
}

}  // namespace

template <typename T>
void RunQMatMul(const MatMulSizes& s, const Quantization& q, const T* x, const QuantizedMatrix<T>& w, T* y,
                const ParallelFor& parallel_for) {
  if (q.bits == 8) {
    RunBits<8>(s, q, x, w, y, parallel_for);
  } else {
    RunBits<4>(s, q, x, w, y, parallel_for);
  }
}

template void RunQMatMul<float>(const MatMulSizes&, const Quantization&, const float*, const QuantizedMatrix<float>&,
                                float*, const ParallelFor&);
template void RunQMatMul<uint16_t>(const MatMulSizes&, const Quantization&, const uint16_t*,
                                   const QuantizedMatrix<uint16_t>&, uint16_t*, const ParallelFor&);

}  // namespace INFMOE_VARIANT
}  // namespace infmoe
