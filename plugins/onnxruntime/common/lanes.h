// Registers of floats (Lanes) and the conversions into them, per CPU variant.
#pragma once

#include "common/variant.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

// W floats as a GCC/Clang vector (one register of the variant). Each weight format picks its
// width: kNarrow for float weights, whose loops are memory bound (AVX-512 loads stream no faster
// than AVX2 ones), kWide for quantized
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


}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe
