// Integer dot products of quantized rows with int8 activations (the session option
// infmoe.activations = int8; docs/guide/quantization.md): each token's activations are quantized
// once per call, per group of 32 columns (scale = max |x| / 127, round half to even), and a row's
// dot with a token is, per group, an exact integer sum of q times qx, scaled by the weight
// block's scale times the group's. Where compute binds (int4 on AVX2, batches, prefill) this does
// the work of the float loops in fewer instructions and converts no weight to float.
// Every (token, row) sum is its own: the same bits for any tokens beside it in a call of the same
// size and any number of threads. Calls of up to kRowsUpTo tokens (rows read as stored) and larger
// ones (tiles) add a row's groups in different orders (float rounding apart).
#pragma once

#include "common/weight_formats.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

constexpr int64_t kGroup = 32;
  // activation columns per scale: one AVX2 register of int8

// A token's activations for the integer dots: per group, the 32 int8 values and scale / zero
// groups past d. int8 rows read a group's values in column order; int4 rows read them as a row's
// nibbles unpack, pairs of groups at a time: per pair (2 p, 2 p + 1) 64 bytes, the even columns
// of both groups (16 each), then their odd columns. Groups are padded with zeros (values, scales
// and offsets) to a multiple of 8, so whole registers of groups can be read. A group holding a
// NaN or infinity gets a NaN scale: the token's dots become NaN, as the float path's would.
struct QuantizedTokens {
  int bits;
  int64_t groups;
  int64_t lanes;             // groups rounded up to 8: scales and offsets a token
  std::vector<int8_t> q;     // [tokens, lanes, 32]
  std::vector<float> scale;  // [tokens, lanes]
  // [tokens, lanes]: 8 times the group's sum of qx. int4 rows' nibbles are u = q + 8, so a
  // group's sum of u . qx is this much more than its sum of q . qx.
  std::vector<int32_t> offset;

  template <typename T>
  QuantizedTokens(const T* x, int64_t tokens, int64_t d, int row_bits)
      : bits(row_bits), groups((d + kGroup - 1) / kGroup), lanes((groups + 7) / 8 * 8), q(tokens * lanes * kGroup, 0),
        scale(tokens * lanes, 0.0f), offset(tokens * lanes, 0) {
    float v[kGroup];
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t n = std::min(kGroup, d - g * kGroup);
#if defined(__AVX2__)
        if constexpr (std::is_same_v<T, float>) {
          if (n == kGroup) {
            QuantizeGroup(x + t * d + g * kGroup, t, g);
            continue;
          }
        }
#endif
        float most = 0.0f;
        bool finite = true;
        for (int64_t c = 0; c < kGroup; ++c) {
          v[c] = c < n ? ToFloat(x[t * d + g * kGroup + c]) : 0.0f;
          finite = finite && std::isfinite(v[c]);
          most = std::max(most, std::fabs(v[c]));
        }
        float& s = scale[t * lanes + g];
        if (!finite) {
          s = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        if (most == 0.0f) continue;
        s = most / 127.0f;
        for (int64_t c = 0; c < kGroup; ++c) {
          int8_t& out = q[t * lanes * kGroup + Slot(g, c)];
          out = static_cast<int8_t>(std::clamp(std::nearbyint(v[c] / s), -127.0f, 127.0f));
          offset[t * lanes + g] += 8 * out;
        }
      }
    }
  }
#if defined(__AVX2__)
  // A whole group of float x as the scalar loop above quantizes it, in registers: the same
  // maximum, division and rounding (half to even), so the same bits, without a division per value
  // on the scalar unit.
  void QuantizeGroup(const float* x, int64_t t, int64_t g) {
    __m256 v[4];
    __m256 most = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), _mm256_setzero_ps(), _CMP_EQ_OQ));
      most = _mm256_max_ps(most, _mm256_and_ps(v[i], magnitude));
    }
    float& s = scale[t * lanes + g];
    if (_mm256_movemask_ps(finite) != 0xff) {
      s = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    if (largest == 0.0f) return;
    s = largest / 127.0f;
    const __m256 step = _mm256_set1_ps(s), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
    __m256i qi[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, bottom), top));
      total = _mm256_add_epi32(total, qi[i]);
    }
    // int32 -> int8 in column order: the packs interleave 128-bit lanes, the permutation undoes it.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    int8_t* values = &q[t * lanes * kGroup];
    if (bits == 4) {  // even columns, then odd ones (Slot)
      const __m256i split = _mm256_permute4x64_epi64(
          _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8,
                                                      10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)),
          0xd8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(values + Slot(g, 0)), _mm256_castsi256_si128(split));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(values + Slot(g, 1)), _mm256_extracti128_si256(split, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + Slot(g, 0)), bytes);
    }
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4e));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xb1));
    offset[t * lanes + g] = 8 * _mm_cvtsi128_si32(sum);
  }
#endif
  // Where column c of group g lies in a token's values.
  int64_t Slot(int64_t g, int64_t c) const {
    return bits == 4 ? g / 2 * 2 * kGroup + c % 2 * kGroup + g % 2 * (kGroup / 2) + c / 2 : g * kGroup + c;
  }
  const int8_t* Values(int64_t t) const { return &q[t * lanes * kGroup]; }
  // int8 rows: group g's 32 values in column order.
  const int8_t* Group(int64_t t, int64_t g) const { return Values(t) + g * kGroup; }
  // int4 rows: group g's even columns' 16 values, its odd columns' 16 at + kGroup.
  const int8_t* Even(int64_t t, int64_t g) const { return Values(t) + Slot(g, 0); }
  float Scale(int64_t t, int64_t g) const { return scale[t * lanes + g]; }

  // The tokens as T [tokens, d]: qx times its group's scale (the integer dots' operands), which
  // the float paths multiply instead of x.
  template <typename T>
  std::vector<T> Dequantized(int64_t tokens, int64_t d) const {
    std::vector<T> out(tokens * d);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t c = 0; c < d; ++c) {
        const int64_t g = c / kGroup;
        FromFloat(static_cast<float>(Values(t)[Slot(g, c % kGroup)]) * Scale(t, g), &out[t * d + c]);
      }
    return out;
  }
};

// Bytes of one group of a row (32 columns).
template <int Bits>
constexpr int64_t kGroupBytes = kGroup * Bits / 8;

// dots[t ldd + j] = token ids[t] . row lo + j for t < tokens, j < rows, in plain C++ (the variants
// without AVX2): per group the exact integer sum, scaled by the weight block's scale times the
// group's and added in group order. Rows are read in whole groups (each row at least
// groups * kGroupBytes bytes, its padding q = 0); per_block: groups per block of a row's scales.
template <int Bits, typename T>
void PortableIntDots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<Bits, T>& w,
                     int64_t per_block, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
  for (int64_t j = 0; j < rows; ++j) {
    const auto row = w.At(lo + j);
    for (int64_t t = 0; t < tokens; ++t) {
      const int8_t* qx = x.Values(ids[t]);
      float acc = 0.0f;
      for (int64_t g = 0; g < x.groups; ++g) {
        const uint8_t* src = row.q + g * kGroupBytes<Bits>;
        int32_t sum = 0;
        for (int64_t c = 0; c < kGroup; ++c) {
          const int q = Bits == 8 ? src[c] - 128 : ((src[c / 2] >> (4 * (c % 2))) & 15) - 8;
          sum += q * qx[x.Slot(g, c)];
        }
        acc += static_cast<float>(sum) * (ToFloat(row.scale[g / per_block]) * x.Scale(ids[t], g));
      }
      dots[t * ldd + j] = acc;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kIntTileRows = 16;
constexpr int kIntTileTokens = 8;  // acc and p per token, beside the weights: within 32 registers
#else
constexpr int kIntTileRows = 8;
constexpr int kIntTileTokens = 4;  // p and acc per token, beside the weights: within 16 registers
#endif
constexpr int64_t kIntTileBytes = 8 * 4 * kIntTileRows;  // a tile's group: 8 steps of 4 bytes a row

#if defined(__AVX2__)
// int4 rows on AVX2 eight at a time, row l in lane l (as llama.cpp's repacked q4_0 GEMM lays them
// out, here transposed on the fly from SPEC §6's storage): per group of 32 columns, eight
// vpmaddubsw each take 4 columns of all 8 rows against 4 of a token's int8 activations
// (broadcast), their 16-bit pair sums added in 16 bits (at most 8 x 2 x 15 x 127, exact), one
// vpmaddwd, the offset of the nibbles subtracted, and one FMA by the 8 rows' scales times the
// token's. No horizontal sums, and a tile's transposed groups serve every token.
// With AVX-512 VNNI a tile is 16 rows (one zmm register) and takes 8 tokens at a time: vpdpbusd
// adds 32-bit sums in place, each token's sum is a chain of 8 of them a group, and 8 tokens' chains
// side by side keep the unit busy where 4 waited on their own latency. Each lane computes what the
// 8-row tile computes (the same integers, the same FMA per group): the same bits.

// Group g (bytes 16 g .. 16 g + 15) of 8 rows as vpmaddubsw's unsigned operands: steps[i] (i < 4),
// lane l, holds the low nibbles of row l's bytes 4 i .. 4 i + 3 (columns 8 i, 8 i + 2, 8 i + 4,
// 8 i + 6: QuantizedTokens' int4 slots 4 i .. 4 i + 3), steps[4 + i] their high nibbles (the odd
// columns after them: slots 16 + 4 i ..); step i at steps + i stride (a 16-row tile: two 8-row
// halves side by side, 64 bytes a step).
template <int Bits>
inline void TileGroup(const uint8_t* const* row, int64_t g, uint8_t* steps, int64_t stride);

template <>
inline void TileGroup<4>(const uint8_t* const* row, int64_t g, uint8_t* steps, int64_t stride) {
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
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + stride * i), _mm256_and_si256(dword[i], mask));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + stride * (4 + i)),
                        _mm256_and_si256(_mm256_srli_epi16(dword[i], 4), mask));
  }
}

// Group g (bytes 32 g .. 32 g + 31) of 8 int8 rows as stored (u = q + 128, vpdpbusd's unsigned
// operand): steps[i] (i < 8), lane l, holds row l's bytes 4 i .. 4 i + 3 (columns 4 i ..: the
// token's int8 slots in column order). An 8 x 8 transpose of dwords in registers.
template <>
inline void TileGroup<8>(const uint8_t* const* row, int64_t g, uint8_t* steps, int64_t stride) {
  const int64_t at = g * kGroupBytes<8>;
  __m256i r[8], t[8];
  for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[l] + at));
  for (int l = 0; l < 8; l += 2) t[l] = _mm256_unpacklo_epi32(r[l], r[l + 1]), t[l + 1] = _mm256_unpackhi_epi32(r[l], r[l + 1]);
  for (int l = 0; l < 8; l += 4) {  // r[l + i]: dwords i (low half) and 4 + i (high) of rows l .. l + 3
    r[l] = _mm256_unpacklo_epi64(t[l], t[l + 2]), r[l + 1] = _mm256_unpackhi_epi64(t[l], t[l + 2]);
    r[l + 2] = _mm256_unpacklo_epi64(t[l + 1], t[l + 3]), r[l + 3] = _mm256_unpackhi_epi64(t[l + 1], t[l + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + stride * i), _mm256_permute2x128_si256(r[i], r[4 + i], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + stride * (4 + i)),
                        _mm256_permute2x128_si256(r[i], r[4 + i], 0x31));
  }
}

// Where step i (4 columns of each row) finds a token's 4 int8 activations of group g: StepOffset
// bytes on from GroupActivations, int4's even columns then odd ones (QuantizedTokens::Slot),
// int8's in column order.
template <int Bits>
inline const int8_t* GroupActivations(const QuantizedTokens& x, int64_t t, int64_t g) {
  return Bits == 4 ? x.Even(t, g) : x.Group(t, g);
}
template <int Bits>
constexpr int64_t StepOffset(int i) {
  return Bits == 4 ? (i < 4 ? 4 * i : kGroup + 4 * (i - 4)) : 4 * i;
}
// The stored offset's multiple of a group's sum of qx: nibbles u = q + 8, bytes u = q + 128
// (QuantizedTokens keeps 8 times the sum).
template <int Bits>
constexpr int kOffsetTimes = Bits == 4 ? 1 : 16;

// The 8 32-bit sums of q . qx over each 4 bytes, stored bytes u = q + 128 against int8 activations,
// on AVX2: u times 127 would overflow vpmaddubsw's 16-bit pair sums, so |q| against the activations
// carrying q's sign (at most 2 x 127 x 127), widened by vpmaddwd. Exact; no offset.
inline __m256i SignedDots(__m256i u, __m256i qx) {
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(qx, q)), _mm256_set1_epi16(1));
}

// out[kIntTileRows t + l] = token ids[t] . tile row l, t < Tt; steps: the tile's groups
// (TileGroup, kIntTileBytes each), scales: its rows' block scales [block][kIntTileRows].
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int Tt, int Bits>
void TileDots(const QuantizedTokens& x, const int64_t* ids, const uint8_t* steps, const float* scales,
              int64_t per_block, float* out) {
  __m512 acc[Tt];
  for (int t = 0; t < Tt; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    __m512i p[Tt];
    for (int t = 0; t < Tt; ++t) p[t] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      const __m512i w = _mm512_loadu_si512(steps + kIntTileBytes * g + 64 * i);
      for (int t = 0; t < Tt; ++t) {
        int32_t four;
        std::memcpy(&four, GroupActivations<Bits>(x, ids[t], g) + StepOffset<Bits>(i), sizeof four);
        p[t] = _mm512_dpbusd_epi32(p[t], w, _mm512_set1_epi32(four));
      }
    }
    const __m512 ws = _mm512_loadu_ps(scales + g / per_block * kIntTileRows);
    for (int t = 0; t < Tt; ++t) {
      const int64_t at = ids[t] * x.lanes + g;
      const __m512i sum = _mm512_sub_epi32(p[t], _mm512_set1_epi32(kOffsetTimes<Bits> * x.offset[at]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[at])), acc[t]);
    }
  }
  for (int t = 0; t < Tt; ++t) _mm512_storeu_ps(out + kIntTileRows * t, acc[t]);
}
#else
template <int Tt, int Bits>
void TileDots(const QuantizedTokens& x, const int64_t* ids, const uint8_t* steps, const float* scales,
              int64_t per_block, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[Tt];
  for (int t = 0; t < Tt; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    __m256i p[Tt];  // int4: 16-bit pair sums; int8: 32-bit sums
    const int8_t* a[Tt];  // each token's activations of the group
    for (int t = 0; t < Tt; ++t) p[t] = _mm256_setzero_si256(), a[t] = GroupActivations<Bits>(x, ids[t], g);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps + kIntTileBytes * g + 32 * i));
#pragma GCC unroll 8
      for (int t = 0; t < Tt; ++t) {
        int32_t four;
        std::memcpy(&four, a[t] + StepOffset<Bits>(i), sizeof four);
        const __m256i qx = _mm256_set1_epi32(four);
        if constexpr (Bits == 4) {
          p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(w, qx));
        } else {
          p[t] = _mm256_add_epi32(p[t], SignedDots(w, qx));
        }
        // Each step's sum in a register before the next: without this GCC reassociates the
        // integer adds into a tree over all 8 steps and spills the 32 products it keeps alive.
        asm("" : "+x"(p[t]));
      }
    }
    const __m256 ws = _mm256_loadu_ps(scales + g / per_block * kIntTileRows);
    for (int t = 0; t < Tt; ++t) {
      const int64_t at = ids[t] * x.lanes + g;
      // The exact sums q . qx, as vpdpbusd's less their offset (int8's here carry none).
      const __m256i sum =
          Bits == 4 ? _mm256_sub_epi32(_mm256_madd_epi16(p[t], ones), _mm256_set1_epi32(x.offset[at])) : p[t];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, _mm256_set1_ps(x.scale[at])), acc[t]);
    }
  }
  for (int t = 0; t < Tt; ++t) _mm256_storeu_ps(out + kIntTileRows * t, acc[t]);
}
#endif

// scales[b stride + l] = row l's scale of block b for l < 8, b < blocks: float scales 8 blocks at a
// time through an 8 x 8 transpose in registers, the rest one by one.
template <typename T>
void TileScales(const T* const* scale, int64_t blocks, float* scales, int64_t stride) {
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
        _mm256_storeu_ps(scales + (b + i) * stride, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
        _mm256_storeu_ps(scales + (b + 4 + i) * stride, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
      }
    }
  }
  for (; b < blocks; ++b)
    for (int l = 0; l < 8; ++l) scales[b * stride + l] = ToFloat(scale[l][b]);
}

// Asks for rows [lo, lo + n) of w in L2, a line at a time, ahead of their first read. Rows lie
// stride bytes apart, their scales blocks apart. Always inlined: GCC takes a function of
// prefetches alone for one without effects and drops its calls.
template <int Bits, typename T>
[[gnu::always_inline]] inline void PrefetchRows(const QuantRows<Bits, T>& w, int64_t lo, int64_t n) {
  const auto first = w.At(lo);
  const char* q = reinterpret_cast<const char*>(first.q);
  const char* scale = reinterpret_cast<const char*>(first.scale);
  for (int64_t i = 0; i < n * w.stride; i += 64) __builtin_prefetch(q + i, 0, 2);
  for (int64_t i = 0; i < n * w.blocks * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(scale + i, 0, 2);
}

// IntDots of int4 and int8 rows: tile by tile, its groups transposed once for
// all the tokens. The next tile's rows are fetched while this tile's dots run: read from memory as
// the transposition reads them (16 or 32 bytes of each of 16 rows at a time, too scattered for the
// hardware prefetchers), they stalled it for about as long as the dots of 16 tokens take.
template <int Bits, typename T>
void TiledDots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<Bits, T>& w,
               int64_t per_block, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
  static constexpr auto kDots = CountTable<kIntTileTokens>([](auto n) { return &TileDots<decltype(n)::value, Bits>; });
  thread_local std::vector<uint8_t> steps;
  thread_local std::vector<float> scales;
  steps.resize(x.groups * kIntTileBytes);
  scales.resize(w.blocks * kIntTileRows);
  constexpr int64_t kStep = 4 * kIntTileRows;  // bytes of one step of a tile's group
  for (int64_t j = 0; j < rows; j += kIntTileRows) {
    const int64_t n = std::min<int64_t>(kIntTileRows, rows - j);
    const uint8_t* row[kIntTileRows];
    const T* scale[kIntTileRows];
    for (int l = 0; l < kIntTileRows; ++l) {  // a partial tile repeats its last row in the spare lanes
      const auto r = w.At(lo + j + std::min<int64_t>(l, n - 1));
      row[l] = r.q, scale[l] = r.scale;
    }
    for (int half = 0; half < kIntTileRows; half += 8) {  // 8 rows a pass: lanes half .. half + 7
      TileScales(scale + half, w.blocks, scales.data() + half, kIntTileRows);
      for (int64_t g = 0; g < x.groups; ++g) TileGroup<Bits>(row + half, g, steps.data() + kIntTileBytes * g + 4 * half, kStep);
    }
    if (const int64_t next = std::min<int64_t>(kIntTileRows, rows - j - kIntTileRows); next > 0)
      PrefetchRows(w, lo + j + kIntTileRows, next);
    for (int64_t t = 0; t < tokens; t += kIntTileTokens) {
      const int64_t tt = std::min<int64_t>(kIntTileTokens, tokens - t);
      float lanes[kIntTileTokens * kIntTileRows];
      kDots[tt - 1](x, ids + t, steps.data(), scales.data(), per_block, lanes);
      for (int64_t k = 0; k < tt; ++k)
        std::memcpy(dots + (t + k) * ldd + j, lanes + kIntTileRows * k, n * sizeof(float));
    }
  }
}
#endif

#if defined(__AVX2__)
// Rows on AVX2 one at a time, for a few tokens: a row's bytes as stored, 8 groups a chunk, each
// token's 8 exact group sums brought into one register in group order (a few horizontal adds per
// chunk), less their offsets, and one FMA by the row's scales times the token's. A row streams
// from memory with loads only; a tile first writes its transposed groups, which pays off only
// over more tokens.
// int4: one load a pair of groups, a mask and a shift give both groups' even and odd columns (as
// QuantizedTokens lays out a pair), two vpmaddubsw (or vpdpbusd) per token and pair.
// int8: one load a group; vpdpbusd on the stored bytes u = q + 128 (their offset: 128 times the
// group's sum of qx), or on AVX2 SignedDots (no offset), as the tiles make them.
constexpr int kRowTokens = 3;  // per token its partial sums and acc, beside the weights' registers
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kRowVnni = true;
#else
constexpr bool kRowVnni = false;
#endif
// Up to this many tokens rows beat tiles in a decode step, where the rows come from memory. int4
// with AVX-512 VNNI: by a wide margin at 1 and 2 tokens, about even at 4 (benchmarks/peers.py);
// on AVX2 by a wide margin at 1 token, about even at 2, the tiles faster from 3 on (whole
// all-int4 steps and QMatMul alone, libraries alternating in one process). int8: at 1 (whole
// all-int8 steps, alternating runs: at 2 and 4 the tiles were faster).
template <int Bits>
constexpr int64_t kRowsUpTo = Bits == 4 ? (kRowVnni ? 4 : 2) : 1;
// The multiple of QuantizedTokens' offset (8 times a group's sum of qx) that a row's group sums
// carry: int4's nibbles u = q + 8 once; int8's bytes 16 times through vpdpbusd, none on AVX2.
template <int Bits>
constexpr int kRowOffsetTimes = Bits == 4 ? 1 : kRowVnni ? 16 : 0;

// sums[t] = token qx[t]'s sums (before offsets) with groups c .. c + 7 of the int4 row of bytes q,
// lane i group c + i, t < Tt. kFull: all 8 groups are in the row; else those past x.groups are zeros.
template <int Tt, bool kFull>
inline void GroupSums4(const QuantizedTokens& x, const int8_t* const* qx, const uint8_t* q, int64_t c, __m256i* sums) {
  const __m256i mask = _mm256_set1_epi8(15);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // AVX2 only
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the adds leave g0 g2 g4 g6 | g1 g3 g5 g7
  __m256i half[Tt][2], first[Tt];
  for (int k = 0; k < 4; ++k) {
    const int64_t g = c + 2 * k;  // the pair's first group
    const uint8_t* bytes = q + g * kGroupBytes<4>;
    __m256i v = _mm256_setzero_si256();
    if (kFull || g + 1 < x.groups) {
      v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    } else if (g < x.groups) {  // a last group alone: the row holds no more bytes
      v = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    }
    const __m256i even = _mm256_and_si256(v, mask), odd = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    for (int t = 0; t < Tt; ++t) {
      const int8_t* pair = qx[t] + g * kGroup;
      const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
      const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + kGroup));
      __m256i s;
      if constexpr (kRowVnni) {
        // 32-bit sums, 4 a group (lanes 0-3: group g, 4-7: g + 1)
        s = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), even, xe), odd, xo);
      } else {
        // 16-bit sums, 8 a group (lanes 0-7: group g, 8-15: g + 1), each of at most 2 x 2 x 15 x 127
        s = _mm256_add_epi16(_mm256_maddubs_epi16(even, xe), _mm256_maddubs_epi16(odd, xo));
      }
      if (k % 2 == 0) {
        first[t] = s;
      } else if constexpr (kRowVnni) {
        half[t][k / 2] = _mm256_hadd_epi32(first[t], s);  // 2 a group
      } else {
        half[t][k / 2] = _mm256_hadd_epi16(first[t], s);  // 4 a group, each at most 15240
      }
    }
  }
  for (int t = 0; t < Tt; ++t) {
    __m256i pairs;
    if constexpr (kRowVnni) {
      pairs = _mm256_hadd_epi32(half[t][0], half[t][1]);  // one a group
    } else {
      // 2 a group (at most 30480: exact in 16 bits), then one a group in 32 bits
      pairs = _mm256_madd_epi16(_mm256_hadd_epi16(half[t][0], half[t][1]), ones);
    }
    sums[t] = _mm256_permutevar8x32_epi32(pairs, in_order);
  }
}

// GroupSums4 for int8 rows: per group one register of 8 partial sums a token, paired by
// horizontal adds as the groups come (2, then 4 groups a register) and the two halves of groups
// c .. c + 3 and c + 4 .. c + 7 added last.
template <int Tt, bool kFull>
inline void GroupSums8(const QuantizedTokens& x, const int8_t* const* qx, const uint8_t* q, int64_t c, __m256i* sums) {
  __m256i pair[Tt] = {}, quad[Tt] = {};  // set before read (GCC cannot tell)
  for (int i = 0; i < 8; ++i) {
    const int64_t g = c + i;
    const bool present = kFull || g < x.groups;
    const __m256i v = present ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroupBytes<8>))
                              : _mm256_setzero_si256();
    for (int t = 0; t < Tt; ++t) {
      __m256i s = _mm256_setzero_si256();
      if (present) {
        const __m256i xg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[t] + g * kGroup));
        if constexpr (kRowVnni) {
          s = _mm256_dpbusd_epi32(s, v, xg);
        } else {
          s = SignedDots(v, xg);
        }
      }
      if (i % 2 == 0) {
        pair[t] = s;
        continue;
      }
      const __m256i two = _mm256_hadd_epi32(pair[t], s);  // g g g' g' | g g g' g'
      if (i % 4 == 1) {
        quad[t] = two;
        continue;
      }
      const __m256i four = _mm256_hadd_epi32(quad[t], two);  // c+0 .. c+3 (or c+4 ..), lanes 0-3 | lanes 4-7
      if (i == 3) {
        sums[t] = four;
      } else {
        sums[t] = _mm256_add_epi32(_mm256_permute2x128_si256(sums[t], four, 0x20),
                                   _mm256_permute2x128_si256(sums[t], four, 0x31));
      }
    }
  }
}

// Adds to acc[t] token ids[t]'s dot with groups c .. c + 7 of the row of bytes q, t < Tt; ws: the
// row's scale per group.
template <int Bits, int Tt, bool kFull>
inline void RowChunk(const QuantizedTokens& x, const int8_t* const* qx, const int64_t* ids, const uint8_t* q,
                     const float* ws, int64_t c, __m256* acc) {
  __m256i sums[Tt] = {};  // set by GroupSums (GCC cannot tell)
  if constexpr (Bits == 4) {
    GroupSums4<Tt, kFull>(x, qx, q, c, sums);
  } else {
    GroupSums8<Tt, kFull>(x, qx, q, c, sums);
  }
  const __m256 w = _mm256_loadu_ps(ws + c);
  for (int t = 0; t < Tt; ++t) {
    const int64_t at = ids[t] * x.lanes + c;
    __m256i exact = sums[t];
    if constexpr (kRowOffsetTimes<Bits> != 0) {
      const __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.offset[at]));
      exact = _mm256_sub_epi32(exact, _mm256_mullo_epi32(offset, _mm256_set1_epi32(kRowOffsetTimes<Bits>)));
    }
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(w, _mm256_loadu_ps(&x.scale[at])), acc[t]);
  }
}

// out[r Tt + t] = token ids[t] . row r (bytes q[r], scales per group ws[r]: x.lanes, zeros past the
// groups), r < Rr, t < Tt. Rows side by side load each token's activations once for all of them:
// that pays at two tokens (one row at a time reloads both tokens' activations for every row).
template <int Bits, int Tt, int Rr>
void RowDots(const QuantizedTokens& x, const int64_t* ids, const uint8_t* const* q, const float* const* ws,
             float* out) {
  const int8_t* qx[Tt];
  __m256 acc[Rr][Tt];
  for (int t = 0; t < Tt; ++t) qx[t] = x.Values(ids[t]);
  for (int r = 0; r < Rr; ++r)
    for (int t = 0; t < Tt; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= x.groups; c += 8)
    for (int r = 0; r < Rr; ++r) RowChunk<Bits, Tt, true>(x, qx, ids, q[r], ws[r], c, acc[r]);
  if (c < x.groups)
    for (int r = 0; r < Rr; ++r) RowChunk<Bits, Tt, false>(x, qx, ids, q[r], ws[r], c, acc[r]);
  for (int r = 0; r < Rr; ++r)
    for (int t = 0; t < Tt; ++t) {
      Lanes<8> v;
      std::memcpy(&v, &acc[r][t], sizeof v);
      out[r * Tt + t] = SumLanes<8>(v);
    }
}

// Rows a RowDots call takes side by side: int4's two on AVX2; one with AVX-512 VNNI (paired rows
// ran slower there), and int8's one (GroupSums8's pairing of groups does not fit the registers
// twice). decisions.md.
template <int Bits>
constexpr int kRowPair = Bits == 4 && !kRowVnni ? 2 : 1;

// How far ahead of its dots RowIntDots fetches rows. Streamed row after row, the rows are still
// read faster when fetched by hand: the hardware prefetchers left one core's reads well below
// the fp32 MatMul's on the same matrix, int4 on one token most (kernel.md).
constexpr int64_t kRowsAhead = 8;

// IntDots row by row (RowDots), kRowPair<Bits> rows at a time.
template <int Bits, typename T>
void RowIntDots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<Bits, T>& w,
                int64_t per_block, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
  static constexpr auto kAlone = CountTable<kRowTokens>([](auto n) { return &RowDots<Bits, decltype(n)::value, 1>; });
  static constexpr auto kPaired =
      CountTable<kRowTokens>([](auto n) { return &RowDots<Bits, decltype(n)::value, kRowPair<Bits>>; });
  thread_local std::vector<float> expanded;
  expanded.assign(kRowPair<Bits> * x.lanes, 0.0f);
  // Float scales a group each, a whole number of registers of them: read where they are.
  const bool as_stored = std::is_same_v<T, float> && per_block == 1 && x.groups == x.lanes;
  for (int64_t j = 0; j < rows; j += kRowPair<Bits>) {
    const int64_t n = std::min<int64_t>(kRowPair<Bits>, rows - j);
    if (const int64_t ahead = j + kRowsAhead; ahead < rows)
      PrefetchRows(w, lo + ahead, std::min<int64_t>(kRowPair<Bits>, rows - ahead));
    const uint8_t* q[kRowPair<Bits>];
    const float* ws[kRowPair<Bits>];
    for (int64_t r = 0; r < n; ++r) {
      const auto row = w.At(lo + j + r);
      q[r] = row.q;
      ws[r] = expanded.data() + r * x.lanes;
      if constexpr (std::is_same_v<T, float>) {
        if (as_stored) ws[r] = row.scale;
      }
      if (!as_stored)
        for (int64_t g = 0; g < x.groups; ++g) expanded[r * x.lanes + g] = ToFloat(row.scale[g / per_block]);
    }
    for (int64_t t = 0; t < tokens; t += kRowTokens) {
      const int64_t tt = std::min<int64_t>(kRowTokens, tokens - t);
      float out[kRowPair<Bits> * kRowTokens];
      (n == kRowPair<Bits> ? kPaired : kAlone)[tt - 1](x, ids + t, q, ws, out);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t k = 0; k < tt; ++k) dots[(t + k) * ldd + j + r] = out[r * tt + k];
    }
  }
}
#endif

// dots[t ldd + j] = token ids[t] . row lo + j for t < tokens, j < rows; block_size a multiple of 32.
template <int Bits, typename T>
void IntDots(const QuantizedTokens& x, const int64_t* ids, int64_t tokens, const QuantRows<Bits, T>& w,
             int64_t block_size, int64_t lo, int64_t rows, float* dots, int64_t ldd) {
#if defined(__AVX2__)
  if (tokens <= kRowsUpTo<Bits>) return RowIntDots(x, ids, tokens, w, block_size / kGroup, lo, rows, dots, ldd);
  return TiledDots(x, ids, tokens, w, block_size / kGroup, lo, rows, dots, ldd);
#else
  PortableIntDots(x, ids, tokens, w, block_size / kGroup, lo, rows, dots, ldd);
#endif
}

}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe
