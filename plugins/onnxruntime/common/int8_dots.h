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

constexpr int64_t kGroup = 32;  // activation columns per scale: one AVX2 register of int8

// A token's activations for the integer dots: per group, the 32 int8 values (int4 rows: the
// group's even columns, then its odd ones, as a row's nibbles unpack) and scale / zero groups
// past d. A group holding a NaN or infinity gets a NaN scale: the token's dots become NaN, as
// the float path's would.
struct QuantizedTokens {
  int bits;
  int64_t groups;
  std::vector<int8_t> q;     // [tokens, groups, 32]
  std::vector<float> scale;  // [tokens, groups]

  template <typename T>
  QuantizedTokens(const T* x, int64_t tokens, int64_t d, int row_bits)
      : bits(row_bits), groups((d + kGroup - 1) / kGroup), q(tokens * groups * kGroup, 0), scale(tokens * groups, 0.0f) {
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
        }
      }
    }
  }
  const int8_t* Group(int64_t t, int64_t g) const { return &q[(t * groups + g) * kGroup]; }

#if defined(__AVX2__)
  // int4 rows' offset per lane of a group: their nibbles are u = q + 8, so a lane's sum of u . qx
  // is 8 times its qx (pairs of pairs, as vpmaddubsw and vpmaddwd add them) too many.
  __m256i Offset(int64_t t, int64_t g) const {
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Group(t, g)));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), qx), _mm256_set1_epi16(1));
  }
#endif

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
// An int4 row's group as its 32 stored nibbles u = q + 8, one a byte: the even columns, then the
// odd ones (QuantizedTokens' order). vpmaddubsw takes them unsigned: pair sums of at most
// 2 x 15 x 127, no saturation.
inline __m256i WeightGroup4(const uint8_t* src) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
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
  __m256 acc[Tt][Jr];
  for (int t = 0; t < Tt; ++t)
    for (int j = 0; j < Jr; ++j) acc[t][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (Bits == 4) {
      __m256i qx[Tt];
      for (int t = 0; t < Tt; ++t) qx[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.Group(ids[t], g)));
      for (int j = 0; j < Jr; ++j) {
        const auto row = w.At(lo + j);
        const __m256i u = WeightGroup4(row.q + g * kGroupBytes<Bits>);
        const float ws = ToFloat(row.scale[g / per_block]);
        for (int t = 0; t < Tt; ++t) {
          const __m256i sum = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, qx[t]), _mm256_set1_epi16(1)),
                                               x.Offset(ids[t], g));
          const __m256 s = _mm256_set1_ps(ws * x.scale[ids[t] * groups + g]);
          acc[t][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc[t][j]);
        }
      }
    } else {
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
  }
  for (int t = 0; t < Tt; ++t)
    for (int j = 0; j < Jr; ++j) {
      Lanes<8> v;
      std::memcpy(&v, &acc[t][j], sizeof v);
      dots[t * ldd + j] = SumLanes<8>(v);
    }
#else
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
#endif
}

// The register blocks, tokens x rows, within AVX2's 16 registers: int4 4 x 2 accumulators beside
// the tokens' bytes; int8 2 x 4 beside their 16-bit activations (two registers a token).
template <int Bits>
constexpr int kIntTokens = Bits == 4 ? 4 : 2;
template <int Bits>
constexpr int kIntRows = Bits == 4 ? 2 : 4;

template <int Bits, typename T, size_t... I>
constexpr auto IntDotTable(std::index_sequence<I...>) {
  using Fn = void (*)(const QuantizedTokens&, const int64_t*, const QuantRows<Bits, T>&, int64_t, int64_t, float*, int64_t);
  return std::array<Fn, sizeof...(I)>{&IntDotBlock<static_cast<int>(I / kIntRows<Bits>) + 1,
                                                   static_cast<int>(I % kIntRows<Bits>) + 1, Bits, T>...};
}

// dots[t ldd + j] = token ids[t] . row lo + j for t < tokens, j < rows; block_size a multiple of 32.
template <int Bits, typename T>
void IntDots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<Bits, T>& w,
             int64_t block_size, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
  constexpr int kTokens = kIntTokens<Bits>, kRows = kIntRows<Bits>;
  static constexpr auto kBlocks = IntDotTable<Bits, T>(std::make_index_sequence<kTokens * kRows>());
  for (int64_t t = 0; t < tokens; t += kTokens) {
    const int64_t tt = std::min<int64_t>(kTokens, tokens - t);
    for (int64_t j = 0; j < rows; j += kRows) {
      const int64_t jr = std::min<int64_t>(kRows, rows - j);
      kBlocks[(tt - 1) * kRows + (jr - 1)](x, ids + t, w, block_size / kGroup, lo + j, dots + t * ldd + j, ldd);
    }
  }
}

}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe
