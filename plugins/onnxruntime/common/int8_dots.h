// Integer dot products of quantized rows with int8 activations (the session option
// infmoe.activations = int8; docs/guide/quantization.md): each token's activations are quantized
// once per call, per group of 32 columns (scale = max |x| / 127, round half to even), and a row's
// dot with a token is, per group, an exact integer sum of q times qx, scaled by the weight
// block's scale times the group's. Where compute binds (int4 on AVX2, batches, prefill) this does
// the work of the float loops in fewer instructions and converts no weight to float.
// Every (token, row) sum is its own, over the groups in order: the same bits for any number of
// tokens beside it, any tiling and any number of threads.
#pragma once

#include <array>

#include "common/weight_formats.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

constexpr int64_t kGroup = 32;
  // activation columns per scale: one AVX2 register of int8

// A token's activations for the integer dots: per group, the 32 int8 values (int4 rows: the
// group's even columns, then its odd ones, as a row's nibbles unpack) and scale / zero groups
// past d. A group holding a NaN or infinity gets a NaN scale: the token's dots become NaN, as
// the float path's would.
struct QuantizedTokens {
  int bits;
  int64_t groups;
  std::vector<int8_t> q;     // [tokens, groups, 32]
  std::vector<float> scale;  // [tokens, groups]
  // [tokens, groups]: 8 times the group's sum of qx. int4 rows' nibbles are u = q + 8, so a
  // group's sum of u . qx is this much more than its sum of q . qx.
  std::vector<int32_t> offset;

  template <typename T>
  QuantizedTokens(const T* x, int64_t tokens, int64_t d, int row_bits)
      : bits(row_bits), groups((d + kGroup - 1) / kGroup), q(tokens * groups * kGroup, 0), scale(tokens * groups, 0.0f),
        offset(tokens * groups, 0) {
    float v[kGroup];
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t n = std::min(kGroup, d - g * kGroup);
        float most = 0.0f;
        bool finite = true;
        for (int64_t c = 0; c < kGroup; ++c) {
          v[c] = c < n ? ToFloat(x[t * d + g * kGroup + c]) : 0.0f;
          finite = finite && std::isfinite(v[c]);
          most = std::max(most, std::fabs(v[c]));
        }
        float& s = scale[t * groups + g];
        if (!finite) {
          s = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        if (most == 0.0f) continue;
        s = most / 127.0f;
        int8_t* out = &q[(t * groups + g) * kGroup];
        for (int64_t c = 0; c < kGroup; ++c) {
          const int64_t slot = bits == 4 ? (c % 2) * (kGroup / 2) + c / 2 : c;
          out[slot] = static_cast<int8_t>(std::clamp(std::nearbyint(v[c] / s), -127.0f, 127.0f));
          offset[t * groups + g] += 8 * out[slot];
        }
      }
    }
  }
  const int8_t* Group(int64_t t, int64_t g) const { return &q[(t * groups + g) * kGroup]; }

  // The tokens as T [tokens, d]: qx times its group's scale (the integer dots' operands), which
  // the float paths multiply instead of x.
  template <typename T>
  std::vector<T> Dequantized(int64_t tokens, int64_t d) const {
    std::vector<T> out(tokens * d);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t c = 0; c < d; ++c) {
        const int64_t g = c / kGroup, slot = c % kGroup;
        const int64_t at = bits == 4 ? (slot % 2) * (kGroup / 2) + slot / 2 : slot;
        FromFloat(static_cast<float>(Group(t, g)[at]) * scale[t * groups + g], &out[t * d + c]);
      }
    return out;
  }
};

#if defined(__AVX2__)
// An int8 row's group as 16-bit q in two registers (columns in order): vpmaddwd's operands, exact
// for any stored byte (vpmaddubsw's 16-bit pair sums could saturate at 255 x 127).
inline void WeightGroup8(const uint8_t* src, __m256i* lo, __m256i* hi) {
  const __m256i bytes = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)),
                                         _mm256_set1_epi8(static_cast<char>(0x80)));
  *lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
  *hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1));
}
#endif

// Bytes of one group of a row (32 columns).
template <int Bits>
constexpr int64_t kGroupBytes = kGroup * Bits / 8;

// dots[t ldd + j] = token ids[t] . row lo + j for Tt tokens and Jr rows, rows read through `w`
// (whole groups: each row at least groups * kGroupBytes bytes, its padding q = 0).
// per_block: groups per block of a row's scales (block_size / 32).
template <int Tt, int Jr, int Bits, typename T>
void IntDotBlock(const QuantizedTokens& x, const int64_t* ids, const QuantRows<Bits, T>& w, int64_t per_block, int64_t lo,
                 float* dots, int64_t ldd) {
  const int64_t groups = x.groups;
#if defined(__AVX2__)
  if constexpr (Bits == 8) {  // int4 rows take the tiles below
    __m256 acc[Tt][Jr];
    for (int t = 0; t < Tt; ++t)
      for (int j = 0; j < Jr; ++j) acc[t][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i xl[Tt], xh[Tt];
      for (int t = 0; t < Tt; ++t) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.Group(ids[t], g)));
        xl[t] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
        xh[t] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1));
      }
      for (int j = 0; j < Jr; ++j) {
        const auto row = w.At(lo + j);
        __m256i wl, wh;
        WeightGroup8(row.q + g * kGroupBytes<Bits>, &wl, &wh);
        const float ws = ToFloat(row.scale[g / per_block]);
        for (int t = 0; t < Tt; ++t) {
          const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(wl, xl[t]), _mm256_madd_epi16(wh, xh[t]));
          const __m256 s = _mm256_set1_ps(ws * x.scale[ids[t] * groups + g]);
          acc[t][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc[t][j]);
        }
      }
    }
    for (int t = 0; t < Tt; ++t)
      for (int j = 0; j < Jr; ++j) {
        Lanes<8> v;
        std::memcpy(&v, &acc[t][j], sizeof v);
        dots[t * ldd + j] = SumLanes<8>(v);
      }
    return;
  }
#endif
  for (int t = 0; t < Tt; ++t) {
    for (int j = 0; j < Jr; ++j) {
      const auto row = w.At(lo + j);
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* qx = x.Group(ids[t], g);
        const uint8_t* src = row.q + g * kGroupBytes<Bits>;
        int32_t sum = 0;
        for (int64_t c = 0; c < kGroup; ++c) {
          // Column c of the group and its slot in qx (int4: even columns first, as the nibbles unpack).
          const int q = Bits == 8 ? src[c] - 128 : ((src[c / 2] >> (4 * (c % 2))) & 15) - 8;
          sum += q * qx[Bits == 4 ? (c % 2) * (kGroup / 2) + c / 2 : c];
        }
        acc += static_cast<float>(sum) * (ToFloat(row.scale[g / per_block]) * x.scale[ids[t] * groups + g]);
      }
      dots[t * ldd + j] = acc;
    }
  }
}

#if defined(__AVX2__)
// int4 rows on AVX2 eight at a time, row l in lane l (as llama.cpp's repacked q4_0 GEMM lays them
// out, here transposed on the fly from SPEC §6's storage): per group of 32 columns, eight
// vpmaddubsw each take 4 columns of all 8 rows against 4 of a token's int8 activations
// (broadcast), their 16-bit pair sums added in 16 bits (at most 8 x 2 x 15 x 127, exact), one
// vpmaddwd, the offset of the nibbles subtracted, and one FMA by the 8 rows' scales times the
// token's. No horizontal sums, and a tile's transposed groups serve every token.
constexpr int kInt4TileRows = 8;
constexpr int kInt4TileTokens = 4;  // p and acc per token, beside the weights: within 16 registers

// Group g (bytes 16 g .. 16 g + 15) of the tile's 8 rows as vpmaddubsw's unsigned operands:
// steps[i] (i < 4), lane l, holds the low nibbles of row l's bytes 4 i .. 4 i + 3 (columns 8 i,
// 8 i + 2, 8 i + 4, 8 i + 6: QuantizedTokens' int4 slots 4 i .. 4 i + 3), steps[4 + i] their high
// nibbles (the odd columns after them: slots 16 + 4 i ..).
inline void TileGroup(const uint8_t* const* row, int64_t g, uint8_t* steps) {
  const int64_t at = g * kGroupBytes<4>;
  const auto rows = [&](int l) {  // rows l and l + 4, one a half
    return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(row[l + 4] + at),
                               reinterpret_cast<const __m128i*>(row[l] + at));
  };
  const __m256i a0 = rows(0), a1 = rows(1), a2 = rows(2), a3 = rows(3);
  const __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpackhi_epi32(a0, a1);
  const __m256i t2 = _mm256_unpacklo_epi32(a2, a3), t3 = _mm256_unpackhi_epi32(a2, a3);
  const __m256i dword[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
  const __m256i mask = _mm256_set1_epi8(15);
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + 32 * i), _mm256_and_si256(dword[i], mask));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + 32 * (4 + i)),
                        _mm256_and_si256(_mm256_srli_epi16(dword[i], 4), mask));
  }
}

// out[8 t + l] = token ids[t] . tile row l, t < Tt; steps: the tile's groups (TileGroup, 256
// bytes each), scales: its rows' block scales [block][8].
template <int Tt>
void TileDots(const QuantizedTokens& x, const int64_t* ids, const uint8_t* steps, const float* scales,
              int64_t per_block, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[Tt];
  for (int t = 0; t < Tt; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    __m256i p[Tt];
    const int8_t* qx[Tt];
    for (int t = 0; t < Tt; ++t) p[t] = _mm256_setzero_si256(), qx[t] = x.Group(ids[t], g);
    for (int i = 0; i < 8; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps + 256 * g + 32 * i));
      for (int t = 0; t < Tt; ++t) {
        int32_t four;
        std::memcpy(&four, qx[t] + 4 * i, sizeof four);
        p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(w, _mm256_set1_epi32(four)));
      }
    }
    const __m256 ws = _mm256_loadu_ps(scales + g / per_block * kInt4TileRows);
    for (int t = 0; t < Tt; ++t) {
      const int64_t at = ids[t] * x.groups + g;
      const __m256i sum = _mm256_sub_epi32(_mm256_madd_epi16(p[t], ones), _mm256_set1_epi32(x.offset[at]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, _mm256_set1_ps(x.scale[at])), acc[t]);
    }
  }
  for (int t = 0; t < Tt; ++t) _mm256_storeu_ps(out + kInt4TileRows * t, acc[t]);
}

// scales[b 8 + l] = row l's scale of block b, b < blocks: float scales 8 blocks at a time through
// an 8 x 8 transpose in registers, the rest one by one.
template <typename T>
void TileScales(const T* const* scale, int64_t blocks, float* scales) {
  int64_t b = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; b + 8 <= blocks; b += 8) {
      __m256 r[8], t[8];
      for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_ps(scale[l] + b);
      for (int l = 0; l < 8; l += 2) t[l] = _mm256_unpacklo_ps(r[l], r[l + 1]), t[l + 1] = _mm256_unpackhi_ps(r[l], r[l + 1]);
      for (int l = 0; l < 8; l += 4) {
        r[l] = _mm256_shuffle_ps(t[l], t[l + 2], 0x44), r[l + 1] = _mm256_shuffle_ps(t[l], t[l + 2], 0xEE);
        r[l + 2] = _mm256_shuffle_ps(t[l + 1], t[l + 3], 0x44), r[l + 3] = _mm256_shuffle_ps(t[l + 1], t[l + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {  // r[i] (rows 0-3) and r[4 + i] (rows 4-7): blocks b + i, b + 4 + i
        _mm256_storeu_ps(scales + (b + i) * 8, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
        _mm256_storeu_ps(scales + (b + 4 + i) * 8, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
      }
    }
  }
  for (; b < blocks; ++b)
    for (int l = 0; l < 8; ++l) scales[b * 8 + l] = ToFloat(scale[l][b]);
}

template <size_t... I>
constexpr auto TileDotTable(std::index_sequence<I...>) {
  using Fn = void (*)(const QuantizedTokens&, const int64_t*, const uint8_t*, const float*, int64_t, float*);
  return std::array<Fn, sizeof...(I)>{&TileDots<static_cast<int>(I) + 1>...};
}

// IntDots of int4 rows: tile by tile, its groups transposed once for all the tokens.
template <typename T>
void TiledInt4Dots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<4, T>& w,
                   int64_t per_block, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
  static constexpr auto kDots = TileDotTable(std::make_index_sequence<kInt4TileTokens>());
  thread_local std::vector<uint8_t> steps;
  thread_local std::vector<float> scales;
  steps.resize(x.groups * 256);
  scales.resize(w.blocks * kInt4TileRows);
  for (int64_t j = 0; j < rows; j += kInt4TileRows) {
    const int64_t n = std::min<int64_t>(kInt4TileRows, rows - j);
    const uint8_t* row[kInt4TileRows];
    const T* scale[kInt4TileRows];
    for (int l = 0; l < kInt4TileRows; ++l) {  // a partial tile repeats its last row in the spare lanes
      const auto r = w.At(lo + j + std::min<int64_t>(l, n - 1));
      row[l] = r.q, scale[l] = r.scale;
    }
    TileScales(scale, w.blocks, scales.data());
    for (int64_t g = 0; g < x.groups; ++g) TileGroup(row, g, steps.data() + 256 * g);
    for (int64_t t = 0; t < tokens; t += kInt4TileTokens) {
      const int64_t tt = std::min<int64_t>(kInt4TileTokens, tokens - t);
      float lanes[kInt4TileTokens * kInt4TileRows];
      kDots[tt - 1](x, ids + t, steps.data(), scales.data(), per_block, lanes);
      for (int64_t k = 0; k < tt; ++k)
        std::memcpy(dots + (t + k) * ldd + j, lanes + kInt4TileRows * k, n * sizeof(float));
    }
  }
}
#endif

// The register blocks of IntDotBlock, tokens x rows: on AVX2 (int8 rows) 2 x 4 accumulators
// beside the tokens' 16-bit activations (two registers a token), within 16 registers.
constexpr int kIntTokens = 2;
constexpr int kIntRows = 4;

template <int Bits, typename T, size_t... I>
constexpr auto IntDotTable(std::index_sequence<I...>) {
  using Fn = void (*)(const QuantizedTokens&, const int64_t*, const QuantRows<Bits, T>&, int64_t, int64_t, float*, int64_t);
  return std::array<Fn, sizeof...(I)>{&IntDotBlock<static_cast<int>(I / kIntRows) + 1,
                                                   static_cast<int>(I % kIntRows) + 1, Bits, T>...};
}

// IntDots in register blocks of IntDotBlock.
template <int Bits, typename T>
void BlockedIntDots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<Bits, T>& w,
                    int64_t per_block, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
  static constexpr auto kBlocks = IntDotTable<Bits, T>(std::make_index_sequence<kIntTokens * kIntRows>());
  for (int64_t t = 0; t < tokens; t += kIntTokens) {
    const int64_t tt = std::min<int64_t>(kIntTokens, tokens - t);
    for (int64_t j = 0; j < rows; j += kIntRows) {
      const int64_t jr = std::min<int64_t>(kIntRows, rows - j);
      kBlocks[(tt - 1) * kIntRows + (jr - 1)](x, ids + t, w, per_block, lo + j, dots + t * ldd + j, ldd);
    }
  }
}

// dots[t ldd + j] = token ids[t] . row lo + j for t < tokens, j < rows; block_size a multiple of 32.
template <int Bits, typename T>
void IntDots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<Bits, T>& w,
             int64_t block_size, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
#if defined(__AVX2__)
  if constexpr (Bits == 4) return TiledInt4Dots(x, ids, tokens, w, block_size / kGroup, lo, rows, dots, ldd);
#endif
  BlockedIntDots(x, ids, tokens, w, block_size / kGroup, lo, rows, dots, ldd);
}

}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe
