// The batched-decode kernels (a few to a few dozen tokens): a block of weight rows is read once,
// as floats (float rows as they lie, others converted into a block of scratch that stays in
// cache), for every token that needs it; depth runs across the lanes, so no lane idles however
// few the tokens. Every output is its own sum over the depth in a fixed order, the same for any
// tiling, any number of tokens beside it and any number of threads: a token's result never
// depends on what it is batched with.
#pragma once

#include <array>

#include "common/weight_formats.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

constexpr int kBatchLanes = kWide;
// Register blocks of the dot kernel: kDotTokens x kDotRows accumulators plus the loads (16
// registers on AVX2, 32 on AVX-512); the axpy kernel keeps kAxpyTokens x 2 registers of outputs.
constexpr int kDotTokens = kBatchLanes == 16 ? 4 : 3;
constexpr int kDotRows = 4;
constexpr int kAxpyTokens = kBatchLanes == 16 ? 12 : 6;
constexpr int64_t kBlockRows = 32;  // rows converted at once: 2 x 32 rows of 768 floats in L2

inline int64_t PaddedDepth(int64_t d) { return (d + kBatchLanes - 1) / kBatchLanes * kBatchLanes; }

// Rows [lo, hi) of w as floats, *ld apart and zero from d to PaddedDepth(d): float rows where
// they lie when d needs no padding, else converted (w' for quantized rows) into scratch.
template <class Format>
const float* FloatBlock(const Format& w, int64_t lo, int64_t hi, std::vector<float>& scratch, int64_t* ld) {
  if constexpr (std::is_same_v<typename Format::Row, const float*>) {
    if (w.d % kBatchLanes == 0) {
      *ld = w.d;
      return w.At(lo);
    }
  }
  *ld = PaddedDepth(w.d);
  scratch.resize((hi - lo) * *ld);
  for (int64_t i = lo; i < hi; ++i) {
    float* dst = scratch.data() + (i - lo) * *ld;
    DequantizeRow(w, i, dst);
    std::fill(dst + w.d, dst + *ld, 0.0f);
  }
  return scratch.data();
}

// The tokens of x [tokens, d] as floats, PaddedDepth(d) apart, zero-padded.
template <typename T>
std::vector<float> PaddedTokens(const T* x, int64_t tokens, int64_t d) {
  const int64_t ld = PaddedDepth(d);
  std::vector<float> out(tokens * ld, 0.0f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < d; ++c) out[t * ld + c] = ToFloat(x[t * d + c]);
  return out;
}

// dots[t ldd + j] = x[t] . w row j over depth (a multiple of the lanes), for Tt tokens and Jr rows.
template <int Tt, int Jr>
void DotBlock(const float* const* x, const float* w, int64_t ldw, int64_t depth, float* dots, int64_t ldd) {
  constexpr int W = kBatchLanes;
  Lanes<W> acc[Tt][Jr];
#pragma GCC unroll 16
  for (int t = 0; t < Tt; ++t)
#pragma GCC unroll 16
    for (int j = 0; j < Jr; ++j) acc[t][j] = Lanes<W>{};
  for (int64_t c = 0; c < depth; c += W) {
    Lanes<W> a[Tt];
#pragma GCC unroll 16
    for (int t = 0; t < Tt; ++t) a[t] = ToLanes<W>(x[t] + c);
#pragma GCC unroll 16
    for (int j = 0; j < Jr; ++j) {
      const Lanes<W> b = ToLanes<W>(w + j * ldw + c);
#pragma GCC unroll 16
      for (int t = 0; t < Tt; ++t) acc[t][j] += a[t] * b;
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < Tt; ++t)
#pragma GCC unroll 16
    for (int j = 0; j < Jr; ++j) dots[t * ldd + j] = SumLanes<W>(acc[t][j]);
}

// out[t][c] += sum over j < rows of h[t ldh + j] w row j [c], for Tt tokens and every c < depth:
// Cols registers of columns at a time, so each broadcast factor serves Cols FMAs.
template <int Tt, int Cols>
void AxpyColumns(const float* h, int64_t ldh, const float* w, int64_t ldw, int64_t rows, int64_t c, float* const* out) {
  constexpr int W = kBatchLanes;
  Lanes<W> acc[Tt][Cols];
#pragma GCC unroll 16
  for (int t = 0; t < Tt; ++t)
#pragma GCC unroll 2
    for (int k = 0; k < Cols; ++k) acc[t][k] = ToLanes<W>(out[t] + c + k * W);
  for (int64_t j = 0; j < rows; ++j) {
    Lanes<W> b[Cols];
#pragma GCC unroll 2
    for (int k = 0; k < Cols; ++k) b[k] = ToLanes<W>(w + j * ldw + c + k * W);
#pragma GCC unroll 16
    for (int t = 0; t < Tt; ++t) {
      const float factor = h[t * ldh + j];
#pragma GCC unroll 2
      for (int k = 0; k < Cols; ++k) acc[t][k] += factor * b[k];
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < Tt; ++t)
#pragma GCC unroll 2
    for (int k = 0; k < Cols; ++k) std::memcpy(out[t] + c + k * W, &acc[t][k], sizeof acc[t][k]);
}
template <int Tt>
void AxpyBlock(const float* h, int64_t ldh, const float* w, int64_t ldw, int64_t rows, int64_t depth, float* const* out) {
  constexpr int W = kBatchLanes;
  int64_t c = 0;
  for (; c + 2 * W <= depth; c += 2 * W) AxpyColumns<Tt, 2>(h, ldh, w, ldw, rows, c, out);
  if (c < depth) AxpyColumns<Tt, 1>(h, ldh, w, ldw, rows, c, out);
}

// The kernels for every block size up to the largest, indexed by size - 1 (the last, partial
// block of tokens or rows takes a smaller one: the same sums).
using DotFn = void (*)(const float* const*, const float*, int64_t, int64_t, float*, int64_t);
template <size_t... I>
constexpr std::array<DotFn, sizeof...(I)> DotTable(std::index_sequence<I...>) {
  return {&DotBlock<static_cast<int>(I / kDotRows) + 1, static_cast<int>(I % kDotRows) + 1>...};
}
constexpr auto kDotBlocks = DotTable(std::make_index_sequence<kDotTokens * kDotRows>());
constexpr auto kAxpyBlocks = CountTable<kAxpyTokens>([](auto n) { return &AxpyBlock<decltype(n)::value>; });

// dots[t ldd + j] = x[t] . w row j for t < tokens, j < rows (x[t] and the rows zero-padded to
// depth, a multiple of the lanes).
inline void Dots(const float* const* x, int64_t tokens, const float* w, int64_t ldw, int64_t rows, int64_t depth,
                 float* dots, int64_t ldd) {
  for (int64_t t = 0; t < tokens; t += kDotTokens) {
    const int64_t tt = std::min<int64_t>(kDotTokens, tokens - t);
    for (int64_t j = 0; j < rows; j += kDotRows) {
      const int64_t jr = std::min<int64_t>(kDotRows, rows - j);
      kDotBlocks[(tt - 1) * kDotRows + (jr - 1)](x + t, w + j * ldw, ldw, depth, dots + t * ldd + j, ldd);
    }
  }
}

// out[t][c] += sum over j < rows of h[t ldh + j] w row j [c] for t < tokens, c < depth.
inline void Axpys(const float* h, int64_t ldh, int64_t tokens, const float* w, int64_t ldw, int64_t rows,
                  int64_t depth, float* const* out) {
  for (int64_t t = 0; t < tokens; t += kAxpyTokens) {
    const int64_t tt = std::min<int64_t>(kAxpyTokens, tokens - t);
    kAxpyBlocks[tt - 1](h + t * ldh, ldh, w, ldw, rows, depth, out + t);
  }
}

}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe
