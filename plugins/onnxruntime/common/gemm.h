// The GEMM of the prefill paths (expert ops and QMatMul).
#pragma once

#include "common/lanes.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

// The GEMMs of prefill, our own rather than Eigen's: it takes the weights as they lie (float rows)
// or as dequantized into scratch, where Eigen packs them once more (with this, QMatMul's prefill
// keeps pace with onnxruntime's MLAS on a prepacked float weight: benchmarks.qmatmul). The tokens are packed once, across the lanes (PackTokens); per
// tile of kTileTokens tokens and strip of kStripColumns output columns, one register block of
// sums runs over the whole depth in order: every output is its own sum, bitwise the same
// for any number of threads.
constexpr int kGemmLanes = kWide;
constexpr int kTileVectors = 2;  // 3 x 8 and 4 x 6 (x 16 lanes) were no faster; 1 x 28 spills
constexpr int kTileTokens = kTileVectors * kGemmLanes;
constexpr int kStripColumns = kGemmLanes == 16 ? 12 : 6;  // 24 or 12 accumulators: the registers

// Tokens as the GEMM reads them: a register block of kTileTokens tokens at a time, one column
// after another; tile i (tokens kTileTokens i ..) at data + i tile_step, column c of it
// depth_step further per column. Lanes past the last token are read and never written out.
struct TokenTiles {
  const float* data;
  int64_t tile_step, depth_step;
};

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

inline TokenTiles TilesOf(const std::vector<float>& packed, int64_t depth) {
  return {packed.data(), depth * kTileTokens, kTileTokens};
}

// Tokens t < tokens as columns: out[c ld + t] = row(t)[c], ld = tokens rounded up to whole tiles
// plus one tile of zeros, so the tiles of any run of consecutive tokens can be read in place
// (ColumnTiles); returns ld.
template <typename Row>
int64_t PackColumns(int64_t tokens, int64_t depth, Row row, std::vector<float>& out) {
  const int64_t ld = (tokens + kTileTokens - 1) / kTileTokens * kTileTokens + kTileTokens;
  out.assign(depth * ld, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    const auto* v = row(t);
    for (int64_t c = 0; c < depth; ++c) out[c * ld + t] = ToFloat(v[c]);
  }
  return ld;
}

// The tiles of tokens first, first + 1, .. of PackColumns' columns.
inline TokenTiles ColumnTiles(const std::vector<float>& columns, int64_t ld, int64_t first) {
  return {columns.data() + first, kTileTokens, ld};
}

// out[j][l] = tile token l . B column j over depth for the tile's first V registers of tokens,
// B(j, c) = b[j][c] (kRows: b's rows, ld apart, as in x . w^T) or b[c][j] (x . w, w's rows ld apart).
template <bool kRows, int V = kTileVectors>
inline void GemmTile(const float* tile, int64_t step, const float* b, int64_t ld, int64_t depth,
                     float (*out)[kTileTokens]) {
  constexpr int W = kGemmLanes;
  // Indexed, but fully unrolled, so GCC keeps them in registers.
  Lanes<W> acc[V][kStripColumns];
#pragma GCC unroll 16
  for (int j = 0; j < kStripColumns; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[v][j] = Lanes<W>{};
  for (int64_t c = 0; c < depth; ++c) {
    Lanes<W> a[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) a[v] = ToLanes<W>(tile + c * step + v * W);
#pragma GCC unroll 16
    for (int j = 0; j < kStripColumns; ++j) {
      const float factor = kRows ? b[j * ld + c] : b[c * ld + j];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[v][j] += a[v] * factor;
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < kStripColumns; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) std::memcpy(out[j] + v * W, &acc[v][j], sizeof acc[v][j]);
}

// y[t, j] = token t . B column j for t < tokens, j < columns (B as in GemmTile), y's rows ldy
// apart, float or half. A last, partial strip is read from a zero-padded copy: never past B's end.
template <bool kRows, typename Y>
void Gemm(const TokenTiles& x, int64_t tokens, int64_t depth, const float* b, int64_t ld, int64_t columns, Y* y,
          int64_t ldy) {
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
    const float* tile = x.data + first / kTileTokens * x.tile_step;
    // A last tile of at most one register of tokens takes one register of sums a column (each
    // lane's sum is the same either way).
    const auto strip = tokens - first <= kGemmLanes ? &GemmTile<kRows, 1> : &GemmTile<kRows>;
    for (int64_t j0 = 0; j0 < columns; j0 += kStripColumns) {
      if (j0 < full) {
        strip(tile, x.depth_step, kRows ? b + j0 * ld : b + j0, ld, depth, out);
      } else {
        strip(tile, x.depth_step, last.data(), kRows ? depth : kStripColumns, depth, out);
      }
      const int64_t n = std::min<int64_t>(kStripColumns, columns - j0);
      for (int64_t l = 0; l < std::min<int64_t>(kTileTokens, tokens - first); ++l) {
        for (int64_t j = 0; j < n; ++j) FromFloat(out[j][l], y + (first + l) * ldy + j0 + j);
      }
    }
  }
}


}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe
