// Weight formats and how the decode loops read them: float rows (float or half), quantized rows
// (SPEC §6's int8 / int4 with block scales), and on AVX-512 quantized rows in a register layout
// without per-weight conversions (PackedRows). Shared by the expert ops and QMatMul.
#pragma once

#include "common/lanes.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

// decode: weight bytes (w_in + w_out) per work item at most: long streams, yet enough chunks to
// share between threads (benchmarks.qop measures it; docs/design/decisions.md has the others tried).
constexpr int64_t kChunkBytes = 512 << 10;
constexpr int64_t kMaxChunkRows = 1024;
constexpr int64_t kFloatPrefetchBytes = 3072;  // decode, float rows on Intel (IntelStreams): prefetch distance
constexpr int64_t kPrefetchRows = 2;       // decode, quantized rows on AVX-512: prefetch distance

// Weight formats. A unit is kWidth consecutive columns of a row. Values(row, u, n) gives unit u
// before scaling (zero beyond n) and Scale(row, b) the scale of the row's b-th block of
// 2^block_shift units, so that the GEMV loops apply a scale once per block, not once per weight.

// How float rows stream at decode on Intel's cores: two runs of a chunk's rows a pass (two
// streams, side by side: DotRows) and a software prefetch kFloatPrefetchBytes ahead, which
// benchmarks.qop found fastest there; on AMD's cores prefetching slowed the loops, so other CPUs
// keep one run and no prefetch (the distances and run counts tried: docs/design/decisions.md).
// Chosen once per process; INFMOE_INTEL_STREAMS=1 or 0 forces either way (tests: both paths on
// any CPU; the prefetch itself exists on x86-64 only).
inline bool IntelStreams() {
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

// ---- decode -------------------------------------------------------------------------------------

// The decode loops take Rows rows a pass, rows i + r stride for r = 0 .. Rows - 1 (Rows streams,
// each front to back through its own run of rows): dots[r stride] = row . x, and
// out += h[r stride] * row for each in that order (DecodeLayout::kRows: float rows two on Intel,
// one elsewhere; quantized rows four on AVX-512, PackedRows, one elsewhere; runs apart rather
// than adjacent rows, which streamed several times slower from memory).

// Float rows (one block, scale 1): the Rows rows side by side unit by unit, so the streams
// interleave at every load; each row has four accumulator chains (unit u into chain u mod 4, to
// hide the FMA latency), and at each unit out takes the rows' products in row order: every sum
// is bit for bit that of one whole row after another, at a cost within the noise.
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

#if defined(__AVX2__) && !defined(__AVX512F__)
// 32 columns of an int8 row (stored u = q + 128) as 4 units of q in floats: per 8 columns one
// widening load and an integer subtraction (exact). The loops below take a block's chunks of 32
// this way; the units' loop of Values (a load, sign flip and widening per 8 columns) kept its loop
// bounds in memory.
inline void Int8Block(const uint8_t* src, Lanes<8>* v) {
  const __m256i offset = _mm256_set1_epi32(128);
  for (int k = 0; k < 4; ++k) {
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * k)));
    v[k] = reinterpret_cast<Lanes<8>>(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, offset)));
  }
}
template <class Format>
constexpr bool kInt8Rows = false;
template <typename T>
constexpr bool kInt8Rows<QuantRows<8, T>> = true;
inline Lanes<8> Fma(Lanes<8> a, Lanes<8> b, Lanes<8> c) {
  return reinterpret_cast<Lanes<8>>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                    reinterpret_cast<__m256>(c)));
}
#endif

// Quantized rows: q . x per block, then one FMA by the block's scale (instead of scaling x per
// unit), blocks alternating between two chains. The arithmetic, not memory, bounds these loops.
template <int Bits, typename T>
inline float Dot(const QuantRows<Bits, T>& w, int64_t i, const Lanes<kWide>* x, int64_t full, int64_t tail) {
  constexpr int W = kWide;
  const typename QuantRows<Bits, T>::Row row = w.At(i);
  const int64_t per_block = int64_t{1} << w.block_shift;
  // Named chains, not an array indexed by b: GCC keeps an indexed array in memory.
  Lanes<W> even = {}, odd = {};
  int64_t b = 0, u = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (Bits == 8) {
    if (per_block % 4 == 0) {  // blocks of whole 32-column chunks: the same products, FMAs and order
      for (; u + per_block <= full; ++b) {
        Lanes<W> v[4];
        Int8Block(row.q + u * W, v);
        Lanes<W> p = v[0] * x[u];
        for (int k = 1; k < 4; ++k) p = Fma(v[k], x[u + k], p);
        for (u += 4; u & (per_block - 1); u += 4) {
          Int8Block(row.q + u * W, v);
          for (int k = 0; k < 4; ++k) p = Fma(v[k], x[u + k], p);
        }
        (b & 1 ? odd : even) += p * w.Scale(row, b);
      }
    }
  }
#endif
  while (u < full) {
    const int64_t end = std::min(u + per_block, full);
    Lanes<W> p = w.Values(row, u, W) * x[u];
    for (++u; u < end; ++u) p += w.Values(row, u, W) * x[u];
    (b & 1 ? odd : even) += p * w.Scale(row, b);
    ++b;
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
  int64_t lo = 0, b = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (kInt8Rows<Format>) {
    if (per_block % 4 == 0) {  // blocks of whole 32-column chunks: the same FMAs
      for (; lo + per_block <= full; lo += per_block, ++b) {
        const Lanes<W> c = Lanes<W>{} + h * w.Scale(row, b);
        for (int64_t u = lo; u < lo + per_block; u += 4) {
          Lanes<W> v[4];
          Int8Block(row.q + u * W, v);
          for (int k = 0; k < 4; ++k) out[u + k] = Fma(c, v[k], out[u + k]);
        }
      }
    }
  }
#endif
  for (; lo < full; lo += per_block, ++b) {
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
// AVX-512 with VNNI and int4 rows on AVX2 (below). Its register layout of a row: slot s, lane l holds column Column(s, l) (>= d:
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

// The batched path's w_out product (ops/continuous_slice_ffn/cpu.cc) through a format's decode
// rows: from a block of the rows converted to floats (common/batched.h), or, where the decode rows
// have a product of their own (kInLayout: int4 rows on AVX2), from the rows as stored into partial
// outputs in the decode layout (Position: where column c lies in them).
template <class Rows>
struct RowsAxpy {
  static constexpr bool kInLayout = false;
};

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include "common/packed_rows.h"
#elif defined(__AVX2__)
#include "common/nibble_rows.h"
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
// dots[t ldd + i] = row lo + i . token t's x for i < rows, t < tokens, the tokens' x `units` slots
// apart: token by token (int4 rows on AVX2: several tokens a pass, common/nibble_rows.h).
template <class Rows>
void DotChunks(const Rows& w, int64_t lo, int64_t rows, const Lanes<Rows::kWidth>* x, int64_t tokens, int64_t units,
               int64_t full, int64_t tail, float* dots, int64_t ldd) {
  for (int64_t t = 0; t < tokens; ++t) DotChunk(w, lo, rows, x + t * units, full, tail, dots + t * ldd);
}

// Rows [lo, hi) as floats, d apart: the float data itself, or converted into scratch.
inline const float* Rows(const FloatRows<float>& w, int64_t lo, int64_t, RowMatrix&) { return w.w + lo * w.d; }
// Units from `first` on of a row of w as floats (w' for quantized rows), at dst + first W.
template <class Format>
void DequantizeUnits(const Format& w, typename Format::Row row, int64_t first, float* dst) {
  constexpr int W = Format::kWidth;
  for (int64_t u = first; u < (w.d + W - 1) / W; ++u) {
    const int64_t n = std::min<int64_t>(W, w.d - u * W);
    const Lanes<W> v = Dequantized(w, row, u, n);
    if (n == W) {  // a constant size: one store, not a call to memcpy
      std::memcpy(dst + u * W, &v, sizeof v);
    } else {
      std::memcpy(dst + u * W, &v, n * sizeof(float));
    }
  }
}
// Row i of w as d floats (w' for quantized rows).
template <class Format>
void DequantizeRow(const Format& w, int64_t i, float* dst) {
  DequantizeUnits(w, w.At(i), 0, dst);
}
#if defined(__AVX2__)
// int4 rows on AVX2 and AVX-512: 32 columns from one 16-byte load, the nibbles split and
// interleaved back into column order, then converted a unit (8 or 16 columns) at a time; the same
// q times the same scale as the units' loop.
template <typename T>
void DequantizeRow(const QuantRows<4, T>& w, int64_t i, float* dst) {
  constexpr int W = QuantRows<4, T>::kWidth, kUnits = 32 / W;
  const auto row = w.At(i);
  const int64_t chunks = w.d / 32;
  const __m128i mask = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.q + 16 * c));
    const __m128i low = _mm_and_si128(b, mask), high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i first = _mm_sub_epi8(_mm_unpacklo_epi8(low, high), eight);   // columns 0 .. 15
    const __m128i second = _mm_sub_epi8(_mm_unpackhi_epi8(low, high), eight);  // 16 .. 31
    for (int k = 0; k < kUnits; ++k) {
      const float scale = w.Scale(row, (kUnits * c + k) >> w.block_shift);
#if defined(__AVX512F__)
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(k == 0 ? first : second));
      _mm512_storeu_ps(dst + 32 * c + W * k, _mm512_mul_ps(q, _mm512_set1_ps(scale)));
#else
      const __m128i half = k < 2 ? first : second;
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k % 2 ? _mm_srli_si128(half, 8) : half));
      _mm256_storeu_ps(dst + 32 * c + W * k, _mm256_mul_ps(q, _mm256_set1_ps(scale)));
#endif
    }
  }
  DequantizeUnits(w, row, kUnits * chunks, dst);
}
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
// int8 rows on AVX2: 32 columns a chunk (Int8Block); the same q times the same scale.
template <typename T>
void DequantizeRow(const QuantRows<8, T>& w, int64_t i, float* dst) {
  const auto row = w.At(i);
  const int64_t chunks = w.d / 32;
  for (int64_t c = 0; c < chunks; ++c) {
    Lanes<8> v[4];
    Int8Block(row.q + 32 * c, v);
    for (int k = 0; k < 4; ++k) {
      const Lanes<8> scaled = v[k] * w.Scale(row, (4 * c + k) >> w.block_shift);
      std::memcpy(dst + 32 * c + 8 * k, &scaled, sizeof scaled);
    }
  }
  DequantizeUnits(w, row, 4 * chunks, dst);
}
#endif
template <class Format>
const float* Rows(const Format& w, int64_t lo, int64_t hi, RowMatrix& scratch) {
  scratch.resize(hi - lo, w.d);
  for (int64_t i = lo; i < hi; ++i) DequantizeRow(w, i, scratch.row(i - lo).data());
  return scratch.data();
}


}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe
