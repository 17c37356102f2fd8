// The CPU computation of infmoe::DecoderAttention. Compiled once per CPU variant.
#include "common/variant.h"
#include "common/gemm.h"
#include "ops/decoder_attention/decoder_attention.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

// ---- DecoderAttention ---------------------------------------------------------------------------
// Causal attention over a KV cache (docs/reference/ops/DecoderAttention.md): per batch row b
// and head h, the new keys and values go into present at positions [past_b, past_b + S); query i
// attends keys j <= past_b + i (j < total_b), scores q . k / sqrt(head_dim) + bias, softmax, times
// the values. Work items are (row, head) pairs, or (row, head, block of queries) in prefill: each
// output is computed by one item in a fixed order, so any thread count gives the same bits.

// Up to this many queries a row: one weights row per (row, head) item.
constexpr int64_t kDecodeQueries = 3;
constexpr int64_t kAttentionQueries = 64;  // prefill: queries an item takes (scores [64, total] in cache)
// Below this many multiply-adds a call stays on the calling thread: a small model's decode step
// (12 heads of 8 over 128 keys: 25 K) costs less than waking the pool.
constexpr int64_t kAttentionInline = int64_t{1} << 16;

// p[j] = exp(p[j] - max) / sum over j < n, in place (Eigen's vectorised exp). p must be aligned as
// Eigen's own arrays are: Eigen takes the elements before the first aligned one by its scalar exp
// and sums in another order, so an unaligned p would change bits with the address.
void Softmax(float* p, int64_t n) {
  Eigen::Map<Eigen::ArrayXf, Eigen::AlignedMax> a(p, n);
  a = (a - a.maxCoeff()).exp();
  a *= 1.0f / a.sum();
}

// x and y hold W / M keys each, M partial sums a key side by side: one register of their 2 W / M
// keys (x's first), M / 2 sums each, partial p + M / 2 added to partial p.
template <int W, int M, size_t... I>
inline Lanes<W> Fold(Lanes<W> x, Lanes<W> y, std::index_sequence<I...>) {
  constexpr int kHalf = M / 2, kKeys = W / M;
  constexpr auto source = [](int i) {
    const int key = i / kHalf, p = i % kHalf;
    return key < kKeys ? key * M + p : W + (key - kKeys) * M + p;
  };
  return __builtin_shufflevector(x, y, source(I)...) + __builtin_shufflevector(x, y, (source(I) + kHalf)...);
}

// v[r]: key r's W partial sums (r < W) -> lane r of one register: key r's sum (v is overwritten).
template <int W, int M = W>
inline Lanes<W> KeySums(Lanes<W>* v) {
  if constexpr (M == 1) {
    return v[0];
  } else {
    for (int i = 0; i < M / 2; ++i) v[i] = Fold<W, M>(v[2 * i], v[2 * i + 1], std::make_index_sequence<W>{});
    return KeySums<W, M / 2>(v);
  }
}

// Rows [from, to) of a head's cache, rows ld elements apart, requested into the cache: a (row,
// head) item's keys and values are short streams that end before the hardware prefetchers have
// ramped up on them, so without this the reads run well below the memory's speed.
template <typename C>
inline void PrefetchRows(const C* rows, int64_t ld, int64_t from, int64_t to) {
  const char* begin = reinterpret_cast<const char*>(rows + from * ld);
  const char* end = reinterpret_cast<const char*>(rows + to * ld);
  for (const char* p = begin; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

// Keys that Scores requests ahead of the pass it multiplies.
constexpr int64_t kPrefetchKeys = 16;

// scores[j] = q . key j for j < n, keys ld elements apart: W keys a pass, their W sums in
// registers (independent chains hide the FMA latency; each key's sum in column order, its lanes
// summed together with the others' by KeySums), then one at a time. Each pass also requests its
// keys' values, which WeightedValues reads next.
// C, here and below: the cache's element, float or float16 (uint16_t), read as float.
template <typename C>
void Scores(const float* q, const C* keys, int64_t ld, int64_t n, int64_t dim, float* scores, const C* values) {
  constexpr int W = std::is_same_v<C, float> ? kNarrow : kWide;
  const int64_t full = dim / W * W;
  auto tail = [&](int64_t j) { float sum = 0.0f; for (int64_t c = full; c < dim; ++c) sum += q[c] * ToFloat(keys[j * ld + c]); return sum; };
  int64_t j = 0;
  PrefetchRows(keys, ld, 0, std::min(n, kPrefetchKeys));
  for (; j + W <= n; j += W) {
    PrefetchRows(keys, ld, std::min(n, j + kPrefetchKeys), std::min(n, j + W + kPrefetchKeys));
    PrefetchRows(values, ld, j, j + W);
    Lanes<W> acc[W] = {};
    for (int64_t c = 0; c < full; c += W) {
      const Lanes<W> qc = ToLanes<W>(q + c);
#pragma GCC unroll 16
      for (int r = 0; r < W; ++r) acc[r] += qc * ToLanes<W>(keys + (j + r) * ld + c);
    }
    Lanes<W> sums = KeySums<W>(acc);
    if (full < dim) for (int r = 0; r < W; ++r) sums[r] += tail(j + r);
    std::memcpy(scores + j, &sums, sizeof sums);
  }
  PrefetchRows(values, ld, j, n);
  for (; j < n; ++j) {
    Lanes<W> acc = {};
    for (int64_t c = 0; c < full; c += W) acc += ToLanes<W>(q + c) * ToLanes<W>(keys + j * ld + c);
    scores[j] = SumLanes<W>(acc) + tail(j);
  }
}

// out[c] = sum over j < n of p[j] value j[c], values ld elements apart: per block of up to eight
// registers of columns (a head_dim of 64 in one), one pass over the keys front to back with the
// sums in registers (a store and reload of out per key made each key wait for the previous one;
// blocks of four read each row in two passes, slower from memory); narrow blocks split the
// keys over chains (key j into chain j mod kChains, added at the end) to hide the FMA latency.
template <typename C>
void WeightedValues(const float* p, const C* values, int64_t ld, int64_t n, int64_t dim, float* out) {
  constexpr int W = std::is_same_v<C, float> ? kNarrow : kWide, kUnits = 8;
  const int64_t full = dim / W;
  auto block = [&](auto units, int64_t u0) __attribute__((always_inline)) {
    constexpr int U = decltype(units)::value, kChains = U >= 8 ? 1 : U >= 4 ? 2 : 4;
    Lanes<W> acc[kChains][U] = {};
    int64_t j = 0;
    for (; j + kChains <= n; j += kChains) {
      for (int r = 0; r < kChains; ++r)
        for (int u = 0; u < U; ++u) acc[r][u] += p[j + r] * ToLanes<W>(values + (j + r) * ld + (u0 + u) * W);
    }
    for (; j < n; ++j)
      for (int u = 0; u < U; ++u) acc[0][u] += p[j] * ToLanes<W>(values + j * ld + (u0 + u) * W);
    for (int u = 0; u < U; ++u) {
      Lanes<W> sum = acc[0][u];
      for (int r = 1; r < kChains; ++r) sum += acc[r][u];
      std::memcpy(out + (u0 + u) * W, &sum, sizeof sum);
    }
  };
  int64_t u0 = 0;
  for (; u0 + kUnits <= full; u0 += kUnits) block(std::integral_constant<int, kUnits>{}, u0);
  if (full - u0 >= 4) block(std::integral_constant<int, 4>{}, u0), u0 += 4;
  if (full - u0 >= 2) block(std::integral_constant<int, 2>{}, u0), u0 += 2;
  if (full - u0 >= 1) block(std::integral_constant<int, 1>{}, u0), u0 += 1;
  for (int64_t c = full * W; c < dim; ++c) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += p[j] * ToFloat(values[j * ld + c]);
    out[c] = sum;
  }
}

// Heads narrower than a register (head_dim 8 on AVX-512): W / M keys side by side in each register
// (a head's cache holds its keys back to back, ld = M), so no lane idles and one fold tree sums
// twice the keys (faster than the paths above for a small model's heads).
// M = head_dim divides W; keys past the last full pass one at a time.
template <int M, typename C>
void PackedScores(const float* q, const C* keys, int64_t n, float* scores) {
  constexpr int W = kWide, kKeys = W / M;
  Lanes<W> qs;
  for (int l = 0; l < W; ++l) qs[l] = q[l % M];
  int64_t j = 0;
  for (; j + W <= n; j += W) {  // W keys in M registers
    Lanes<W> acc[M];
    for (int r = 0; r < M; ++r) acc[r] = qs * ToLanes<W>(keys + (j + r * kKeys) * M);
    const Lanes<W> sums = KeySums<W, M>(acc);
    std::memcpy(scores + j, &sums, sizeof sums);
  }
  for (; j < n; ++j) {
    float sum = 0.0f;
    for (int c = 0; c < M; ++c) sum += q[c] * ToFloat(keys[j * M + c]);
    scores[j] = sum;
  }
}

// Register R of a pass: its kKeys keys' weights, each repeated over that key's M lanes.
template <int W, int M, int R, size_t... I>
inline Lanes<W> Spread(Lanes<W> p, std::index_sequence<I...>) {
  return __builtin_shufflevector(p, p, (R * (W / M) + I / M)...);
}

template <int W, int M, int Chains, typename C, size_t... R>
inline void WeighPass(Lanes<W> p, const C* values, Lanes<W>* acc, std::index_sequence<R...>) {
  ((acc[R % Chains] += Spread<W, M, R>(p, std::make_index_sequence<W>{}) * ToLanes<W>(values + R * W)), ...);
}

// out[c] = sum over j < n of p[j] value j[c], as PackedScores reads the values: W keys a pass (the
// weights of M registers from one load), into C chains; the chains and then the kKeys keys of a
// register added at the end.
template <int M, typename C>
void PackedWeightedValues(const float* p, const C* values, int64_t n, float* out) {
  constexpr int W = kWide, kKeys = W / M, kChains = 4;
  Lanes<W> acc[kChains] = {};
  int64_t j = 0;
  for (; j + W <= n; j += W) WeighPass<W, M, kChains>(ToLanes<W>(p + j), values + j * M, acc, std::make_index_sequence<M>{});
  const Lanes<W> sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float result[M] = {};
  for (int k = 0; k < kKeys; ++k)
    for (int c = 0; c < M; ++c) result[c] += sum[k * M + c];
  for (; j < n; ++j)
    for (int c = 0; c < M; ++c) result[c] += p[j] * ToFloat(values[j * M + c]);
  std::memcpy(out, result, sizeof result);
}

// f(std::integral_constant<int, dim>) where dim < kWide divides kWide (a PackedScores head);
// false otherwise.
template <int M = kWide / 2, class F>
bool WithPackedHead(int64_t dim, F&& f) {
  if constexpr (M < 1) {
    return false;
  } else {
    if (dim == M) return f(std::integral_constant<int, M>{}), true;
    return WithPackedHead<M / 2>(dim, f);
  }
}

// rows [0, n) of a head's cache as float: the cache itself, or (float16) a copy in scratch.
template <typename C>
const float* AsFloat(const C* cache, int64_t n, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<C, float>) {
    return cache;
  } else {
    scratch.resize(n);
    for (int64_t i = 0; i < n; ++i) scratch[i] = ToFloat(cache[i]);
    return scratch.data();
  }
}

template <typename C>
void Attention(const AttentionSizes& s, const float* qkv, const C* past_key, const C* past_value,
               const int32_t* seqlens_k, const float* bias, float* y, C* present_key, C* present_value,
               const ParallelFor& parallel_for) {
  const int64_t dim = s.head_dim, width = 3 * s.heads * dim, heads = s.batch * s.heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const auto past_of = [&](int64_t b) { return static_cast<int64_t>(seqlens_k[b]) + 1 - s.sequence; };
  const auto cache = [&](C* present, int64_t b, int64_t h) { return present + (b * s.heads + h) * s.present * dim; };
  const auto token = [&](int64_t b, int64_t i) { return qkv + (b * s.sequence + i) * width; };
  const bool shared = present_key == past_key && present_value == past_value;
  const int64_t work = heads * s.sequence * (s.total + 1) * dim;
  const ParallelFor& loop = work < kAttentionInline ? InlineFor() : parallel_for;
  // (b, h)'s cache: unless present is past's own buffer, row b's past_b positions copied and the
  // rest zeroed; then the new keys and values after them.
  const auto write_cache = [&](int64_t b, int64_t h) {
    for (int which = 0; which < 2; ++which) {
      C* present = cache(which ? present_value : present_key, b, h);
      if (!shared) {
        const C* past = (which ? past_value : past_key);
        if (past_of(b)) std::memcpy(present, past + (b * s.heads + h) * s.past * dim, past_of(b) * dim * sizeof(C));
        std::fill(present + past_of(b) * dim, present + s.present * dim, C{0});  // +0.0 in float and in half
      }
      for (int64_t i = 0; i < s.sequence; ++i) {
        const float* from = token(b, i) + (1 + which) * s.heads * dim + h * dim;
        C* to = present + (past_of(b) + i) * dim;
        for (int64_t c = 0; c < dim; ++c) FromFloat(from[c], to + c);
      }
    }
  };
  // Query i of row b sees keys j < past_b + i + 1 (those after it are masked, as are none before:
  // left padding comes as bias); their scores become its weights in place.
  const auto seen = [&](int64_t b, int64_t i) { return past_of(b) + i + 1; };
  const auto weigh = [&](int64_t b, int64_t i, float* row) {
    const float* add = bias + ((s.bias_batch ? b : 0) * s.sequence + i) * s.total;
    for (int64_t j = 0; j < seen(b, i); ++j) row[j] = row[j] * scale + add[j];
    Softmax(row, seen(b, i));
  };
  if (s.sequence <= kDecodeQueries) {
    // One weights row per item, rows aligned for Softmax: one allocation per call. An item reads
    // only its own (b, h) cache, so it writes that cache first: one pass of the pool a call.
    const int64_t ld = (s.total + 15) / 16 * 16;
    Eigen::ArrayXf rows(heads * ld);
    loop(static_cast<size_t>(heads), [&](size_t item) {
      const int64_t b = static_cast<int64_t>(item) / s.heads, h = static_cast<int64_t>(item) % s.heads;
      write_cache(b, h);
      float* row = rows.data() + static_cast<int64_t>(item) * ld;
      for (int64_t i = 0; i < s.sequence; ++i) {
        const float* q = token(b, i) + h * dim;
        const C *keys = cache(present_key, b, h), *values = cache(present_value, b, h);
        float* out = y + (b * s.sequence + i) * s.heads * dim + h * dim;
        const int64_t n = seen(b, i);
        const bool packed = WithPackedHead(dim, [&](auto m) {
          PackedScores<m>(q, keys, n, row);
          weigh(b, i, row);
          PackedWeightedValues<m>(row, values, n, out);
        });
        if (!packed) {
          Scores(q, keys, dim, n, dim, row, values);
          weigh(b, i, row);
          WeightedValues(row, values, dim, n, dim, out);
        }
      }
    });
    return;
  }
  // Prefill: the caches written first (a (row, head)'s blocks of queries all read its cache); then
  // per item the scores of its queries by one Gemm, weights, and a second Gemm.
  loop(static_cast<size_t>(heads), [&](size_t item) {
    write_cache(static_cast<int64_t>(item) / s.heads, static_cast<int64_t>(item) % s.heads);
  });
  const int64_t blocks = (s.sequence + kAttentionQueries - 1) / kAttentionQueries;
  loop(static_cast<size_t>(heads * blocks), [&](size_t item) {
    const int64_t pair = static_cast<int64_t>(item) / blocks, block = static_cast<int64_t>(item) % blocks;
    const int64_t b = pair / s.heads, h = pair % s.heads;
    const int64_t first = block * kAttentionQueries, n = std::min(kAttentionQueries, s.sequence - first);
    const int64_t keys = seen(b, first + n - 1), ld = (keys + 15) / 16 * 16;  // rows aligned for Softmax
    Eigen::ArrayXf scores(n * ld);
    std::vector<float> scratch;
    const std::vector<float> queries = PackTokens(n, dim, [&](int64_t t) { return token(b, first + t) + h * dim; });
    Gemm<true>(TilesOf(queries, dim), n, dim, AsFloat(cache(present_key, b, h), keys * dim, scratch), dim, keys,
               scores.data(), ld);
    for (int64_t t = 0; t < n; ++t) {
      float* row = scores.data() + t * ld;
      weigh(b, first + t, row);
      std::fill(row + seen(b, first + t), row + keys, 0.0f);
    }
    const std::vector<float> weights = PackTokens(n, keys, [&](int64_t t) { return scores.data() + t * ld; });
    Gemm<false>(TilesOf(weights, keys), n, keys, AsFloat(cache(present_value, b, h), keys * dim, scratch), dim, dim,
                y + (b * s.sequence + first) * s.heads * dim + h * dim, s.heads * dim);
  });
}


}  // namespace

template <typename C>
void RunAttention(const AttentionSizes& s, const float* qkv, const C* past_key, const C* past_value,
                  const int32_t* seqlens_k, const float* bias, const float* qkv_bias, float* y, C* present_key,
                  C* present_value, const ParallelFor& parallel_for) {
  // The bias added once, into a copy (as its own Add node would: the same bits); a decode step's
  // qkv is a few KB, a prefill's one pass more than the attention's own.
  std::vector<float> biased;
  if (qkv_bias) {
    const int64_t width = 3 * s.heads * s.head_dim;
    biased.assign(qkv, qkv + s.batch * s.sequence * width);
    for (int64_t t = 0; t < s.batch * s.sequence; ++t)
      for (int64_t c = 0; c < width; ++c) biased[t * width + c] += qkv_bias[c];
    qkv = biased.data();
  }
  Attention(s, qkv, past_key, past_value, seqlens_k, bias, y, present_key, present_value, parallel_for);
}

template void RunAttention<float>(const AttentionSizes&, const float*, const float*, const float*, const int32_t*,
                                  const float*, const float*, float*, float*, float*, const ParallelFor&);
template void RunAttention<uint16_t>(const AttentionSizes&, const float*, const uint16_t*, const uint16_t*,
                                     const int32_t*, const float*, const float*, float*, uint16_t*, uint16_t*,
                                     const ParallelFor&);


}  // namespace INFMOE_VARIANT
}  // namespace infmoe
