// Included by common/weight_formats.h inside its namespaces, on AVX-512 with VNNI only: quantized
// rows in a register layout that the decode loops read without per-weight conversions.
// (A fragment, not a header of its own: it extends DecodeRows and DecodeLayout there.)
// Quantized rows on AVX-512, without per-weight conversions. A row's 64-byte group g is 16 dwords
// of kPerDword = 32 / Bits stored values; value k of every dword is one register, as the float
// q 2^(Bits k') (k' = k mod half a dword: the upper half is shifted down 16 bits once per group).
//  * int8: masked into the mantissa of 2^23 (one vpternlogd) the field is the float
//    2^23 + u 2^(8 k'), and one subtraction of 2^23 + 2^(7 + 8 k') leaves q 2^(8 k') exactly.
//  * int4: the field shifted down to the low 4 bits indexes a vpermps table of q 2^(4 k'): shift,
//    vpermps, FMA. Where integer and float vector ops share the FP pipes (Zen 4), and since
//    vpternlogd overwrites an input (a register copy per use), the mask costs 4 vector ops per
//    16 weights, the table at most 3: the faster decode.
// The power of two is undone on the other factor: x is stored times 2^-(Bits k'), the partial
// outputs are kept times 2^(Bits k') and scaled back once, in the final sum (powers of two:
// exact). So slot kPerDword g + k, lane l holds column 16 kPerDword g + kPerDword l + k (the layout of x
// and of the partial outputs); lane l of group g lies in block (16 kPerDword g + kPerDword l) /
// block_size, and ScaleLanes gives each lane its scale.
// kNibbles[k'][u] = (u - 8) 2^(4 k'): int4's q 2^(4 k') by stored nibble u (exact floats).
struct NibbleTables {
  alignas(64) float q[4][16];
  constexpr NibbleTables() : q{} {
    for (int k = 0; k < 4; ++k)
      for (int u = 0; u < 16; ++u) q[k][u] = static_cast<float>((u - 8) * (1 << (4 * k)));
  }
};
constexpr NibbleTables kNibbleTables;
constexpr const auto& kNibbles = kNibbleTables.q;

template <int Bits, typename T>
struct PackedRows {
  static constexpr int kWidth = 16;
  static constexpr int kPerDword = 32 / Bits, kHalf = kPerDword / 2, kGroupColumns = 16 * kPerDword;
  QuantRows<Bits, T> w;
  __m512i scale_index;  // lane l -> its block, counted from the group's first
  int64_t groups, full_groups;  // full_groups: those with 64 bytes (all but a partial last one)
  int64_t scales_per_group;     // blocks a group touches
  int block_log2;

  explicit PackedRows(const QuantRows<Bits, T>& rows) : w(rows) {
    groups = (w.d + kGroupColumns - 1) / kGroupColumns;
    full_groups = w.packed / 64;
    block_log2 = w.block_shift + 4;  // block_size = kWidth << block_shift
    scales_per_group = std::max(int64_t{kGroupColumns} >> block_log2, int64_t{1});
    alignas(64) int32_t index[16];
    for (int l = 0; l < 16; ++l) index[l] = (kPerDword * l) >> block_log2;
    scale_index = _mm512_load_si512(index);
  }
  // Software prefetch kPrefetchRows rows ahead in each stream (faster streamed, neutral in cache;
  // further ahead gained less: benchmarks.qop); a prefetch never faults, past the tensor's end
  // neither. Row's scales here, its group g's bytes in Bytes.
  void Prefetch(typename QuantRows<Bits, T>::Row row) const {
    const char* scale = reinterpret_cast<const char*>(row.scale + kPrefetchRows * w.blocks);
    _mm_prefetch(scale, _MM_HINT_T0);
    _mm_prefetch(scale + w.blocks * sizeof(T) - 1, _MM_HINT_T0);
  }
  // Group g's 64 packed bytes; in the partial last group (tail) nothing past the row's end is
  // read: zero bytes.
  __m512i Bytes(const uint8_t* q, int64_t g, bool tail) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchRows * w.stride + 64 * g), _MM_HINT_T0);
    if (!tail) return _mm512_loadu_si512(q + 64 * g);
    return _mm512_maskz_loadu_epi8((__mmask64{1} << (w.packed - 64 * g)) - 1, q + 64 * g);
  }
  // Each lane's block scale in group g; tail: the row's last group, which may lack blocks.
  // Plain loads of exactly the group's scales where all are there (a masked load was slower in
  // cache), zero above them.
  __m512 ScaleLanes(const T* scale, int64_t g, bool tail) const {
    const int64_t first = (int64_t{kGroupColumns} * g) >> block_log2;
    const T* s = scale + first;
    if (tail) {
      const __mmask16 valid = static_cast<__mmask16>((1u << std::min(scales_per_group, w.blocks - first)) - 1);
      if constexpr (sizeof(T) == 4) return _mm512_permutexvar_ps(scale_index, _mm512_maskz_loadu_ps(valid, s));
      return _mm512_permutexvar_ps(scale_index, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, s)));
    }
    if (scales_per_group == 1) return _mm512_set1_ps(ToFloat(*s));
    __m512 scales;
    if constexpr (sizeof(T) == 4) {
      switch (scales_per_group) {
        case 2: scales = _mm512_castsi512_ps(_mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)))); break;
        case 4: scales = _mm512_zextps128_ps512(_mm_loadu_ps(s)); break;
        default: scales = _mm512_zextps256_ps512(_mm256_loadu_ps(s));  // 8
      }
    } else {
      __m128i halves;
      switch (scales_per_group) {
        case 2: {
          int32_t two;
          std::memcpy(&two, s, sizeof two);
          halves = _mm_cvtsi32_si128(two);
          break;
        }
        case 4: halves = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)); break;
        default: halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));  // 8
      }
      scales = _mm512_cvtph_ps(_mm256_zextsi128_si256(halves));
    }
    return _mm512_permutexvar_ps(scale_index, scales);
  }
  // q 2^(Bits k') of value k of every dword, from the group's bytes (low) and them >> 16 (high).
  static __m512 Q(__m512i low, __m512i high, int k) {
    const int shift = Bits * (k % kHalf);
    if constexpr (Bits == 4) {  // vpermps reads each lane's low 4 bits: the nibble, once shifted down
      const __m512i nibble = k < kHalf ? low : high;
      return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(nibble, shift) : nibble, _mm512_load_ps(kNibbles[k % kHalf]));
    }
    const __m512i field = _mm512_set1_epi32(((1 << Bits) - 1) << shift);
    const __m512i magic = _mm512_set1_epi32(0x4B000000);  // 2^23
    const __m512 offset = _mm512_set1_ps(8388608.0f + static_cast<float>(1 << (Bits - 1 + shift)));
    const __m512i bits = _mm512_ternarylogic_epi32(k < kHalf ? low : high, field, magic, 0xEA);  // (a & b) | c
    return _mm512_sub_ps(_mm512_castsi512_ps(bits), offset);
  }
  // 2^-(Bits k'): what undoes Q's power of two.
  static float Unscale(int64_t slot) { return 1.0f / static_cast<float>(1 << (Bits * (slot % kPerDword % kHalf))); }
};

// int8 too: faster than its natural layout (vpmovsxbd, vcvtdq2ps, FMA) in cache and streamed,
// with four rows a pass as runs (below; adjacent rows side by side streamed slower).
template <int Bits, typename T>
PackedRows<Bits, T> DecodeRows(const QuantRows<Bits, T>& w) {
  return PackedRows<Bits, T>(w);
}
template <int Bits, typename T>
struct DecodeLayout<PackedRows<Bits, T>> {
  using Rows = PackedRows<Bits, T>;
  // Four runs of a chunk's rows side by side, each front to back: x and the partial output are
  // loaded once for four rows, and the hardware prefetcher follows the four streams. Adjacent
  // rows side by side (one stream) streamed slower from memory, with or without software
  // prefetch (docs/design/decisions.md).
  static constexpr int kRows = 4;
  static int64_t Slots(int64_t d) { return (d + Rows::kGroupColumns - 1) / Rows::kGroupColumns * Rows::kPerDword; }
  static int64_t Column(int64_t s, int l) {
    return s / Rows::kPerDword * Rows::kGroupColumns + Rows::kPerDword * l + s % Rows::kPerDword;
  }
  static float XScale(int64_t s) { return Rows::Unscale(s); }

  // int4 dot products in integers (AVX512-VNNI vpdpbusd: 64 byte products an instruction, where
  // the float loop makes 16 per FMA and needs a lookup per 16 weights). Per group g and lane l,
  // the lane's 8 columns c = 128 g + 8 l + j become integers X_c = x_c 2^-E, rounded (E per lane:
  // the largest |x| of the 8 maps to [2^21, 2^22), so |X| < 2^22 and each x moves by at most
  // 2^-22 of that largest, against the float loop's 2^-24 of each product; E >= -149), split
  // exactly into signed bytes X = a 2^16 + b 2^8 + c (|a| <= 64). The unsigned nibbles u = q + 8
  // times the bytes, summed per lane in int32 (below 2^30: no overflow), less the offset 8 sum X,
  // times 2^E as a float, then by the block scale: the lane's q . x with one rounding. A lane
  // holding a non-finite x gets 2^E = NaN, so its rows' dots are NaN.
  // Slots 8 g .. 8 g + 7: byte b of lane l of slot 8 g + i (i < 3) is byte i of X at column
  // 8 l + 2 b (low nibble), of slot 8 g + 3 + i at 8 l + 2 b + 1 (high nibble); slot 8 g + 6: the
  // offsets (int32), 8 g + 7: 2^E (float).
  static constexpr bool kIntegerDot = Bits == 4;
  // x: a token's d floats, zero-padded to whole groups of 128.
  static void PackX(const float* x, int64_t groups, Lanes<16>* slots) {
    const __m512i columns = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
    const __m512i byte = _mm512_set1_epi32(255), half = _mm512_set1_epi32(128);
    for (int64_t g = 0; g < groups; ++g) {
      __m512 v[8], largest = _mm512_setzero_ps();
      __mmask16 finite = 0xFFFF;
      for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_i32gather_ps(_mm512_add_epi32(columns, _mm512_set1_epi32(j)), x + 128 * g, 4);
        const __m512 magnitude = _mm512_abs_ps(v[j]);
        finite &= _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);  // false for NaN too
        largest = _mm512_max_ps(largest, magnitude);
      }
      const __m512 e = _mm512_max_ps(_mm512_sub_ps(_mm512_getexp_ps(largest), _mm512_set1_ps(21.0f)), _mm512_set1_ps(-149.0f));
      __m512i limbs[6] = {}, offset = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        __m512i rest = _mm512_maskz_cvtps_epi32(finite, _mm512_scalef_ps(v[j], _mm512_sub_ps(_mm512_setzero_ps(), e)));
        offset = _mm512_add_epi32(offset, rest);
        for (int i = 0; i < 3; ++i) {
          const __m512i digit = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(rest, half), byte), half);  // in [-128, 128)
          rest = _mm512_srai_epi32(_mm512_sub_epi32(rest, digit), 8);  // exact
          __m512i& limb = limbs[3 * (j & 1) + i];
          limb = _mm512_or_si512(limb, _mm512_slli_epi32(_mm512_and_si512(digit, byte), 8 * (j / 2)));
        }
      }
      Lanes<16>* out = slots + 8 * g;
      for (int i = 0; i < 6; ++i) _mm512_store_si512(out + i, limbs[i]);
      _mm512_store_si512(out + 6, _mm512_slli_epi32(offset, 3));
      _mm512_store_ps(out + 7, _mm512_mask_blend_ps(finite, _mm512_set1_ps(NAN), _mm512_scalef_ps(_mm512_set1_ps(1.0f), e)));
    }
  }
};

// Rows i + r stride (r < Rows) . x into dots[r stride], side by side: each x slot is loaded once
// for all of them and the rows are independent chains, each run its own stream. The lanes are
// summed for all rows at once at the end.
template <int Rows, int Bits, typename T>
inline void DotRows(const PackedRows<Bits, T>& n, int64_t i, int64_t stride, const Lanes<16>* x, int64_t, int64_t,
                    float* dots) {
  constexpr int K = PackedRows<Bits, T>::kPerDword;
  typename QuantRows<Bits, T>::Row row[Rows];
  for (int r = 0; r < Rows; ++r) row[r] = n.w.At(i + r * stride), n.Prefetch(row[r]);
  const __m512* xs = reinterpret_cast<const __m512*>(x);
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    __m512i low[Rows], high[Rows];
    __m512 p[Rows];
    for (int r = 0; r < Rows; ++r) low[r] = n.Bytes(row[r].q, g, tail), high[r] = _mm512_srli_epi32(low[r], 16);
    const __m512* xg = xs + K * g;
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const __m512 xk = xg[k];
      for (int r = 0; r < Rows; ++r) {
        p[r] = k ? _mm512_fmadd_ps(n.Q(low[r], high[r], k), xk, p[r]) : _mm512_mul_ps(n.Q(low[r], high[r], k), xk);
      }
    }
    for (int r = 0; r < Rows; ++r) acc[r] = _mm512_fmadd_ps(p[r], n.ScaleLanes(row[r].scale, g, tail), acc[r]);
  };
  int64_t g = 0;
  for (; g < n.full_groups; ++g) group(g, false);
  if (g < n.groups) group(g, true);
  for (int r = 0; r < Rows; ++r) dots[r * stride] = SumLanes<16>(reinterpret_cast<Lanes<16>>(acc[r]));
}

// int4: the same in integers (DecodeLayout::PackX above has how): per group and row, the nibbles
// times x's three bytes with six vpdpbusd, the bytes' weights applied by shifts in between.
template <int Rows, typename T>
inline void DotRows(const PackedRows<4, T>& n, int64_t i, int64_t stride, const Lanes<16>* x, int64_t, int64_t,
                    float* dots) {
  typename QuantRows<4, T>::Row row[Rows];
  for (int r = 0; r < Rows; ++r) row[r] = n.w.At(i + r * stride), n.Prefetch(row[r]);
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    const Lanes<16>* xg = x + 8 * g;
    for (int r = 0; r < Rows; ++r) {
      const __m512i bytes = n.Bytes(row[r].q, g, tail);
      const __m512i low = _mm512_and_si512(bytes, nibble), high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      __m512i sum = _mm512_setzero_si512();
      for (int i = 2; i >= 0; --i) {
        if (i < 2) sum = _mm512_slli_epi32(sum, 8);
        sum = _mm512_dpbusd_epi32(sum, low, _mm512_load_si512(xg + i));
        sum = _mm512_dpbusd_epi32(sum, high, _mm512_load_si512(xg + 3 + i));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_load_si512(xg + 6)));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_load_ps(xg + 7)), n.ScaleLanes(row[r].scale, g, tail), acc[r]);
    }
  };
  int64_t g = 0;
  for (; g < n.full_groups; ++g) group(g, false);
  if (g < n.groups) group(g, true);
  for (int r = 0; r < Rows; ++r) dots[r * stride] = SumLanes<16>(reinterpret_cast<Lanes<16>>(acc[r]));
}

// Several rows per pass, one after the other per register: fewer loads and stores of out (its
// stores bound the one-row loop), the same sums as one row at a time. out holds the partial
// output times 2^(Bits k') (exact: a power of two), so Q needs no unscaling here.
template <int Rows, int Bits, typename T>
inline void AxpyRows(const PackedRows<Bits, T>& n, int64_t i, int64_t stride, const float* h, int64_t, int64_t,
                     Lanes<16>* out) {
  constexpr int K = PackedRows<Bits, T>::kPerDword;
  typename QuantRows<Bits, T>::Row row[Rows];
  for (int r = 0; r < Rows; ++r) row[r] = n.w.At(i + r * stride), n.Prefetch(row[r]);
  __m512* o = reinterpret_cast<__m512*>(out);
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    __m512i low[Rows], high[Rows];
    __m512 c[Rows];
    for (int r = 0; r < Rows; ++r) {
      low[r] = n.Bytes(row[r].q, g, tail), high[r] = _mm512_srli_epi32(low[r], 16);
      c[r] = _mm512_mul_ps(_mm512_set1_ps(h[r * stride]), n.ScaleLanes(row[r].scale, g, tail));
    }
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      __m512 sum = o[K * g + k];
      for (int r = 0; r < Rows; ++r) sum = _mm512_fmadd_ps(c[r], n.Q(low[r], high[r], k), sum);
      o[K * g + k] = sum;
    }
  };
  int64_t g = 0;
  for (; g < n.full_groups; ++g) group(g, false);
  if (g < n.groups) group(g, true);
}
