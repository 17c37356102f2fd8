// Included by common/weight_formats.h inside its namespaces, on AVX2 without AVX-512 VNNI: int4
// rows in a decode layout that needs no byte shuffle. (A fragment, not a header of its own: it
// extends DecodeRows and DecodeLayout there.)
// A row's 8-byte group g holds columns 16 g .. 16 g + 15, column 16 g + 2 j in byte j's low
// nibble and 16 g + 2 j + 1 in its high one. Zero-extended to 8 dwords (one vpmovzxbd), the low
// nibbles are one mask away and the high ones one shift: slot 2 g holds the group's even columns,
// slot 2 g + 1 its odd ones, and x and the partial outputs are laid out the same way. Per 16
// weights: widen, mask, shift, two conversions and two FMAs, the stored nibbles u = q + 8 taken as
// they are and the 8 accounted for once per block; the natural layout's interleave (one column a
// byte, in order) cost a shuffle and a sign extension per 8.
template <typename T>
struct NibbleRows {
  static constexpr int kWidth = 8;
  static constexpr int kDecodeRows = 1;
  using Row = typename QuantRows<4, T>::Row;
  QuantRows<4, T> w;
  int64_t groups, full_groups;  // full_groups: those with all 8 bytes in the row
  int64_t groups_per_block;

  explicit NibbleRows(const QuantRows<4, T>& rows)
      : w(rows), groups((rows.d + 15) / 16), full_groups(rows.d / 16),
        groups_per_block(int64_t{1} << (rows.block_shift - 1)) {}  // block_size >= 16: block_shift >= 1
  Row At(int64_t i) const { return w.At(i); }
  int64_t RowBytes() const { return w.RowBytes(); }

  // Group g's stored nibbles u = q + 8 as 8 dwords (bytes beyond the row: 0x88, q = 0); kFull:
  // g is one of the row's whole groups (one 8-byte load).
  template <bool kFull>
  __m256i Group(Row row, int64_t g) const {
    if constexpr (kFull) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.q + 8 * g)));
    uint64_t word = 0x8888888888888888ull;
    std::memcpy(&word, row.q + 8 * g, g < full_groups ? 8 : (w.d - 16 * g + 1) / 2);
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(word)));
  }
  // f(g, kFull) for g in [begin, end), kFull a std::bool_constant: true for the row's whole groups,
  // so the loops over them test no row end (a test per group and row kept the compiled loops from
  // holding their factors in registers).
  template <class F>
  static void ForGroups(int64_t begin, int64_t end, int64_t full_groups, F&& f) {
    const int64_t full = std::max(begin, std::min(end, full_groups));
    for (int64_t g = begin; g < full; ++g) f(g, std::true_type{});
    for (int64_t g = full; g < end; ++g) f(g, std::false_type{});
  }
  // The group's even (low nibbles) and odd (high nibbles) columns' stored nibbles u = q + 8, as floats.
  static Lanes<8> Even(__m256i u) {
    return reinterpret_cast<Lanes<8>>(_mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(15))));
  }
  static Lanes<8> Odd(__m256i u) { return reinterpret_cast<Lanes<8>>(_mm256_cvtepi32_ps(_mm256_srli_epi32(u, 4))); }
};

template <typename T>
NibbleRows<T> DecodeRows(const QuantRows<4, T>& w) {
  return NibbleRows<T>(w);
}
template <typename T>
struct DecodeLayout<NibbleRows<T>> {
  static constexpr int kRows = 4;  // AxpyRows: a pass over the partial output serves 4 rows
  static int64_t Slots(int64_t d) { return 2 * ((d + 15) / 16); }
  static int64_t Column(int64_t s, int l) { return s / 2 * 16 + 2 * l + s % 2; }
  static float XScale(int64_t) { return 1.0f; }
  static constexpr bool kIntegerDot = false;
};

// dots[t ldd + i] = row lo + i . token t's x for i < rows, t < Tt; x: Tt tokens in this layout,
// `units` slots apart; eights [Tt][blocks]: 8 times each block's x, summed lane by lane. Per block,
// u . x over the stored nibbles u = q + 8 (converted once for all Tt tokens), less the block's
// eights, then one FMA by the block's scale, blocks alternating between two chains (as Dot over the
// natural layout). A token's sums are the same for any Tt.
template <int Tt, typename T>
void DotTokens(const NibbleRows<T>& w, int64_t lo, int64_t rows, const Lanes<8>* x, int64_t units,
               const Lanes<8>* eights, float* dots, int64_t ldd) {
  const int64_t blocks = w.w.blocks;
  for (int64_t i = 0; i < rows; ++i) {
    const auto row = w.At(lo + i);
    Lanes<8> even[Tt] = {}, odd[Tt] = {};
    for (int64_t g = 0, b = 0; g < w.groups; ++b) {
      const int64_t end = std::min(g + w.groups_per_block, w.groups);
      Lanes<8> p[Tt], p_odd[Tt];
#pragma GCC unroll 4
      for (int t = 0; t < Tt; ++t) p[t] = -eights[t * blocks + b], p_odd[t] = Lanes<8>{};
      NibbleRows<T>::ForGroups(g, end, w.full_groups, [&](int64_t gi, auto full) __attribute__((always_inline)) {
        const __m256i u = w.template Group<decltype(full)::value>(row, gi);
        const Lanes<8> e = NibbleRows<T>::Even(u), o = NibbleRows<T>::Odd(u);
#pragma GCC unroll 4
        for (int t = 0; t < Tt; ++t) p[t] += e * x[t * units + 2 * gi], p_odd[t] += o * x[t * units + 2 * gi + 1];
      });
      g = end;
      const float scale = ToFloat(row.scale[b]);
#pragma GCC unroll 4
      for (int t = 0; t < Tt; ++t) (b & 1 ? odd[t] : even[t]) += (p[t] + p_odd[t]) * scale;
    }
#pragma GCC unroll 4
    for (int t = 0; t < Tt; ++t) dots[t * ldd + i] = SumLanes<8>(even[t] + odd[t]);
  }
}

// dots[t ldd + i] = row lo + i . token t's x for i < rows, t < tokens (x `units` slots apart):
// up to 3 tokens a pass over the rows.
template <typename T>
void DotChunks(const NibbleRows<T>& w, int64_t lo, int64_t rows, const Lanes<8>* x, int64_t tokens, int64_t units,
               int64_t, int64_t, float* dots, int64_t ldd) {
  constexpr int kTokens = 3;  // per token 4 registers of sums beside the row's 2 conversions
  static constexpr auto kDots = CountTable<kTokens>([](auto n) { return &DotTokens<decltype(n)::value, T>; });
  thread_local std::vector<Lanes<8>> eights;
  const int64_t blocks = w.w.blocks;
  eights.assign(tokens * blocks, Lanes<8>{});
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < w.groups; ++g)
      eights[t * blocks + g / w.groups_per_block] += 8.0f * (x[t * units + 2 * g] + x[t * units + 2 * g + 1]);
  for (int64_t t = 0; t < tokens; t += kTokens) {
    const Lanes<8>* xt = x + t * units;
    const Lanes<8>* et = eights.data() + t * blocks;
    kDots[std::min<int64_t>(kTokens, tokens - t) - 1](w, lo, rows, xt, units, et, dots + t * ldd, ldd);
  }
}

// dots[i] = row lo + i . x for i < rows, x in this layout (the natural loop's full and tail are
// not used).
template <typename T>
void DotChunk(const NibbleRows<T>& w, int64_t lo, int64_t rows, const Lanes<8>* x, int64_t, int64_t, float* dots) {
  DotChunks(w, lo, rows, x, 1, 0, 0, 0, dots, rows);
}

// out += h[r stride] * row i + r stride for r < Rows, in one pass over out; out in this layout.
// Per block, c = h times the block's scale, and c q = c u - 8 c: the stored nibbles are
// converted as they are, and the rows' 8 c once from each slot. The factors c and the blocks'
// offsets are made for the whole row first, a register of blocks at a time, and broadcast from
// memory in the pass (loads only): made block by block beside the pass, their scalar products and
// broadcasts took the vector units' slots from the conversions and FMAs. Each slot's sum runs in
// two chains (alternate rows), added at the end.
template <int Rows, typename T>
inline void AxpyRows(const NibbleRows<T>& w, int64_t i, int64_t stride, const float* h, int64_t, int64_t,
                     Lanes<8>* out) {
  typename NibbleRows<T>::Row row[Rows];
  for (int r = 0; r < Rows; ++r) row[r] = w.At(i + r * stride);
  const int64_t blocks = w.w.blocks, padded = (blocks + 7) / 8 * 8;
  thread_local std::vector<Lanes<8>> scratch;  // [Rows + 1][padded / 8]: c per row and block, then the offsets
  scratch.resize((Rows + 1) * padded / 8);
  float* factor = reinterpret_cast<float*>(scratch.data());
  float* offset = factor + Rows * padded;
  for (int64_t b = 0; b < padded; b += 8) {
    Lanes<8> sum{};
    for (int r = 0; r < Rows; ++r) {
      Lanes<8> scale{};
      for (int l = 0; l < 8 && b + l < blocks; ++l) scale[l] = ToFloat(row[r].scale[b + l]);
      const Lanes<8> c = h[r * stride] * scale;
      std::memcpy(factor + r * padded + b, &c, sizeof c);
      sum += 8.0f * c;
    }
    std::memcpy(offset + b, &sum, sizeof sum);
  }
  NibbleRows<T>::ForGroups(0, w.groups, w.full_groups, [&](int64_t gi, auto full) __attribute__((always_inline)) {
    const int64_t b = gi >> (w.w.block_shift - 1);  // gi / groups_per_block: no division in the loop
    Lanes<8> even[2] = {out[2 * gi] - offset[b], Lanes<8>{}}, odd[2] = {out[2 * gi + 1] - offset[b], Lanes<8>{}};
    for (int r = 0; r < Rows; ++r) {
      const __m256i u = w.template Group<decltype(full)::value>(row[r], gi);
      const float c = factor[r * padded + b];
      even[r % 2] += c * NibbleRows<T>::Even(u);
      odd[r % 2] += c * NibbleRows<T>::Odd(u);
    }
    out[2 * gi] = even[0] + even[1], out[2 * gi + 1] = odd[0] + odd[1];
  });
}

// The batched path's w_out product on int4 rows: out[t] += h[t ldh + j] * row lo + j over j < rows,
// for each token t, out in this layout. Per group, each row's nibbles are converted once for all
// the tokens (up to kTokens at a time), whose sums stay in registers; per block, the factors
// h times the row's scale, and their 8 c subtracted once from each slot (as AxpyRows). A token's
// sums are its own, in row order: the same whatever tokens share the block.
template <typename T>
struct RowsAxpy<NibbleRows<T>> {
  static constexpr bool kInLayout = true;
  static constexpr int kTokens = 5;  // two registers of sums a token, beside a row's two conversions and a factor
  // Calls of more tokens take the float blocks: converted once, a block serves a dozen tokens for less.
  static constexpr int64_t kMostTokens = 2 * kTokens;
  static int64_t Position(int64_t c) { return c / 16 * 16 + c % 2 * 8 + c % 16 / 2; }

  template <int Tt>
  static void Block(const NibbleRows<T>& w, int64_t lo, int64_t rows, const float* h, int64_t ldh, float* const* out) {
    thread_local std::vector<float> factor;  // [rows][Tt]: h times the row's scale of the block
    factor.resize(rows * Tt);
    for (int64_t g = 0, b = 0; g < w.groups; ++b) {
      float offset[Tt] = {};
      for (int64_t j = 0; j < rows; ++j) {
        const float scale = ToFloat(w.At(lo + j).scale[b]);
#pragma GCC unroll 8
        for (int t = 0; t < Tt; ++t) factor[j * Tt + t] = h[t * ldh + j] * scale, offset[t] += 8.0f * factor[j * Tt + t];
      }
      const int64_t end = std::min(g + w.groups_per_block, w.groups);
      NibbleRows<T>::ForGroups(g, end, w.full_groups, [&](int64_t gi, auto full) __attribute__((always_inline)) {
        Lanes<8> even[Tt], odd[Tt];
#pragma GCC unroll 8
        for (int t = 0; t < Tt; ++t) {
          std::memcpy(&even[t], out[t] + 16 * gi, sizeof even[t]);
          std::memcpy(&odd[t], out[t] + 16 * gi + 8, sizeof odd[t]);
          even[t] -= offset[t], odd[t] -= offset[t];
        }
        for (int64_t j = 0; j < rows; ++j) {
          const __m256i u = w.template Group<decltype(full)::value>(w.At(lo + j), gi);
          const Lanes<8> e = NibbleRows<T>::Even(u), o = NibbleRows<T>::Odd(u);
#pragma GCC unroll 8
          for (int t = 0; t < Tt; ++t) {
            const float c = factor[j * Tt + t];
            even[t] += c * e, odd[t] += c * o;
          }
        }
#pragma GCC unroll 8
        for (int t = 0; t < Tt; ++t) {
          std::memcpy(out[t] + 16 * gi, &even[t], sizeof even[t]);
          std::memcpy(out[t] + 16 * gi + 8, &odd[t], sizeof odd[t]);
        }
      });
      g = end;
    }
  }

  static void Run(const NibbleRows<T>& w, int64_t lo, int64_t rows, const float* h, int64_t ldh, int64_t tokens,
                  float* const* out) {
    static constexpr auto kBlocks = CountTable<kTokens>([](auto n) { return &Block<decltype(n)::value>; });
    for (int64_t t = 0; t < tokens; t += kTokens)
      kBlocks[std::min<int64_t>(kTokens, tokens - t) - 1](w, lo, rows, h + t * ldh, ldh, out + t);
  }
};
