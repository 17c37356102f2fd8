// Both ops, float and quantized (SPEC §4, §6), share one computation over a weight format: a
// format hands out a register's worth of columns of a row as float (FloatRows: float or half; QuantRows: 8- or 4-bit
// integers times their block scale, w' = q * scale exactly as the reference dequantizes).
// Two paths, both touching only the union of the windows:
//  * decode (few tokens): per token, the rows its windows cover are cut into fixed chunks; each
//    chunk reads its w_in rows once, front to back (quantized rows on AVX-512: four runs of them
//    side by side), for dot products, applies bias, GELU and coverage, then reads its w_out rows
//    once the same way (int4 rows on AVX2 too: four runs a pass over the chunk's partial output);
//    partials are summed in chunk order.
//    Parallel over chunks, so one token uses every thread; memory bound, so the inner loops work
//    on whole registers of floats and nothing is converted or copied outside them.
//  * prefill (many tokens): whole tokens, or their windows one by one, sorted by window start
//    and grouped (PlanPrefill: the cheaper); per group, the row ranges its windows cover in
//    blocks of hidden units, per block GEMMs (Gemm: register blocks over the items) of the
//    items that reach into it, weighted by each item's coverage, whose partial outputs are
//    summed in block order. A block of half or quantized rows is first converted into float
//    scratch that stays in cache.
// QMatMul (a dense quantized matrix: the onnxruntime target's attention and LM head) reuses both
// paths with every row covered and nothing after the dot products.
// With int8 activations (QContinuousSliceFFN, session option infmoe.activations = int8) x is
// quantized once per call (common/int8_dots.h) and every path makes w_in's dots in integers on it
// (w_out's products, over rows, stay float).
// Work is split by token and by fixed row chunks, never by thread, so the summation order (and
// so every bit of the result) is the same for any number of threads.
// Compiled once per CPU variant (common/variant.h).
#include "common/variant.h"
#include "common/batched.h"
#include "common/gemm.h"
#include "common/int8_dots.h"
#include "common/paths.h"
#include "common/weight_formats.h"
#include "ops/continuous_slice_ffn/continuous_slice_ffn.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

constexpr int64_t kGroupTokens = 128;      // prefill: whole tokens per GEMM group
constexpr int64_t kGroupPairs = 32, kMostGroupPairs = 512;  // prefill: single windows per GEMM group
constexpr int64_t kRowCost = 16;           // prefill plans: a row's reading, in items' GEMMs on it
// Prefill: windows of at most kShortWindow units take blocks of 64 hidden units per work item and
// groups whose starts lie within 2 r; longer ones blocks of 128 and starts within r / 2. A window
// computes up to a block more rows than it covers, and writes (then the sum reads) one partial
// output per block it reaches, so long windows take long blocks; a group's partials grow with
// its spread times r, and for long windows wide groups no longer stay in cache.
constexpr int64_t kShortWindow = 512;
inline int64_t HiddenBlock(const Sizes& s) { return s.r <= kShortWindow ? 64 : 128; }
inline int64_t GroupSpread(const Sizes& s) { return s.r <= kShortWindow ? 2 * s.r : s.r / 2; }
constexpr int64_t kMergeGap = 32;          // prefill: fill uncovered gaps shorter than this
constexpr int64_t kSumItems = 16;          // prefill: items per work item of the partials' sum
constexpr size_t kKeptPlan = 1024;         // decode: windows a thread keeps room for between calls

// GPT-2's tanh GELU, in place, vectorised by Eigen.
template <typename ArrayLike>
void GeluTanh(ArrayLike&& a) {
  const float sqrt_2_over_pi = 0.7978845608028654f;
  a = 0.5f * a * (1.0f + (sqrt_2_over_pi * (a + 0.044715f * a.cube())).tanh());
}

// coverage[i - lo] = (number of the k windows [s, s + r) covering unit i) / k, for i in [lo, hi).
// Form (docs/reference/spec.md §6.3): the exact count n_i (small integers: exact in float), then
// n_i * (1/k): equal to n_i / k up to the last bit.
void Coverage(const int64_t* starts, int64_t k, int64_t r, int64_t lo, int64_t hi, float* coverage) {
  std::fill(coverage, coverage + (hi - lo), 0.0f);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t i = std::max(lo, starts[j]); i < std::min(hi, starts[j] + r); ++i) coverage[i - lo] += 1.0f;
  }
  const float per_window = 1.0f / static_cast<float>(k);
  for (int64_t i = 0; i < hi - lo; ++i) coverage[i] *= per_window;
}

struct Range {
  int64_t lo, hi;
};

// The runs of units covered by a token's windows, merged across gaps shorter than `gap`, in order
// (in place: Merge turns the windows into the runs).
void AddWindows(const int64_t* starts, int64_t k, int64_t r, std::vector<Range>& windows) {
  for (int64_t j = 0; j < k; ++j) windows.push_back({starts[j], starts[j] + r});
}
void Merge(std::vector<Range>& windows, int64_t gap) {
  std::sort(windows.begin(), windows.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  size_t runs = 0;
  for (const Range& w : windows) {  // run `runs` - 1 lies at or before w
    if (runs && w.lo - windows[runs - 1].hi < gap) {
      windows[runs - 1].hi = std::max(windows[runs - 1].hi, w.hi);
    } else {
      windows[runs++] = w;
    }
  }
  windows.resize(runs);
}

// A format's bits a weight when quantized, else 0.
template <class Format>
constexpr int kBitsOf = 0;
template <int Bits, typename T>
constexpr int kBitsOf<QuantRows<Bits, T>> = Bits;

// dots[i] = token t . row lo + i of w_in for i < rows, as integer dots on xq (int8 activations).
template <class Format>
void IntDotsOf(const QuantizedTokens& xq, const int64_t* token, int64_t n, const Format& w_in, int64_t lo, int64_t rows,
               float* dots) {
  if constexpr (kBitsOf<Format> != 0) IntDots(xq, token, n, w_in, int64_t{Format::kWidth} << w_in.block_shift, lo, rows, dots, rows);
}

// With xq (int8 activations, whole groups of 32 columns) w_in's dots are integer ones
// (common/int8_dots.h).
template <typename T, class Format>
void Decode(const Sizes& s, const T* x, const QuantizedTokens* xq, const int64_t* starts, const Format& format_in,
            const T* b_in, const Format& format_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  const auto& w_in = DecodeRows(format_in);
  const auto& w_out = DecodeRows(format_out);
  using Rows = std::decay_t<decltype(w_in)>;
  using Layout = DecodeLayout<Rows>;
  constexpr int W = Rows::kWidth;
  const int64_t full = s.d / W, tail = s.d % W, units = Layout::Slots(s.d);
  // Chunks of a fixed number of rows (from the format's row size, never from the thread count).
  const int64_t chunk_rows =
      std::clamp<int64_t>(kChunkBytes / (format_in.RowBytes() + format_out.RowBytes()), 1, kMaxChunkRows);
  struct Chunk {
    int64_t token, lo, hi;
  };
  // The plan in vectors the calling thread keeps (a call allocates no more once they have grown:
  // a small model's step calls this op a dozen times). The work items, run on the pool's threads
  // too, reach the caller's through the reference.
  thread_local std::vector<Chunk> thread_chunks;
  thread_local std::vector<Range> windows;
  std::vector<Chunk>& chunks = thread_chunks;
  chunks.clear();
  thread_local std::vector<size_t> first_chunk;
  first_chunk.assign(s.tokens + 1, 0);
  for (int64_t t = 0; t < s.tokens; ++t) {
    windows.clear();
    AddWindows(starts + t * s.k, s.k, s.r, windows);
    Merge(windows, 1);
    for (const Range& run : windows) {
      // The fewest chunks of at most chunk_rows rows, rounded up to an even number (two threads
      // split a run evenly), all of one size (+-1 row).
      const int64_t length = run.hi - run.lo;
      int64_t n = (length + chunk_rows - 1) / chunk_rows;
      n = std::min(n + (n > 1 && n % 2), length);
      for (int64_t j = 0; j < n; ++j) chunks.push_back({t, run.lo + length * j / n, run.lo + length * (j + 1) / n});
    }
    first_chunk[t + 1] = chunks.size();
  }
  // With xq, w_in's dots read the int8 activations: no float copy of x.
  const std::vector<Lanes<W>> xs = xq ? std::vector<Lanes<W>>() : DecodeX<Rows, Format>(x, s.tokens, s.d);

  // Every chunk writes its whole partial: no zeroing here (a memset of all of them per call).
  const std::unique_ptr<Lanes<W>[]> partials(new Lanes<W>[chunks.size() * units]);
  parallel_for(chunks.size(), [&](size_t index) {
    const Chunk& c = chunks[index];
    const Lanes<W>* xt = xq ? nullptr : &xs[c.token * units];
    Lanes<W>* out = &partials[index * units];
    float hidden[kMaxChunkRows], coverage[kMaxChunkRows];
    const int64_t rows = c.hi - c.lo;
    if (xq) {
      IntDotsOf(*xq, &c.token, 1, format_in, c.lo, rows, hidden);
    } else {
      DotChunk(w_in, c.lo, rows, xt, full, tail, hidden);
    }
    for (int64_t i = 0; i < rows; ++i) hidden[i] += ToFloat(b_in[c.lo + i]);
    Eigen::Map<Eigen::ArrayXf> h(hidden, rows);
    GeluTanh(h);
    Coverage(starts + c.token * s.k, s.k, s.r, c.lo, c.hi, coverage);
    h *= Eigen::Map<const Eigen::ArrayXf>(coverage, rows);
    std::fill(out, out + units, Lanes<W>{});
    constexpr int kRows = Layout::kRows;
    const int64_t run = rows / kRows;
    for (int64_t i = 0; i < run; ++i) AxpyRows<kRows>(w_out, c.lo + i, run, hidden + i, full, tail, out);
    for (int64_t i = kRows * run; i < rows; ++i) AxpyRows<1>(w_out, c.lo + i, 0, hidden + i, full, tail, out);
  });

  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t u = 0; u < units; ++u) {
      // The partials are stored divided by XScale (powers of two: exact), so is b_out here.
      Lanes<W> sum = Slot<Rows, Format>(b_out, s.d, u) / Layout::XScale(u);
      for (size_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) sum += partials[c * units + u];
      sum *= Layout::XScale(u);
      for (int l = 0; l < W; ++l) {
        const int64_t column = Layout::Column(u, l);
        if (column < s.d) FromFloat(sum[l], y + t * s.d + column);
      }
    }
  }
  // A plan this large came from thousands of windows a token: not kept for the thread's next call.
  if (windows.capacity() > kKeptPlan) std::vector<Range>().swap(windows), std::vector<Chunk>().swap(chunks);
}

template <typename T>
Vector ToVector(const T* v, int64_t n) {
  Vector out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = ToFloat(v[i]);
  return out;
}

// A prefill plan: items (a token with windows [k0, k0 + windows) of its K) in groups whose GEMMs
// run over the union of their windows' rows, a block of HiddenBlock rows at a time for the items
// that reach into it; cost, per block its rows times those items plus kRowCost (reading a row, or
// converting a quantized one, costs about as much as the GEMMs of a dozen items on it).
struct PrefillPlan {
  struct Item {
    int64_t token, k0, windows;
  };
  std::vector<Item> items;
  std::vector<int64_t> ends;  // group g is items [ends[g - 1], ends[g])
  int64_t cost = 0;
};

// The union of the items' windows, merged across gaps under kMergeGap, cut into blocks of
// HiddenBlock rows (a range's last block shorter).
inline std::vector<Range> UnionBlocks(const Sizes& s, const int64_t* starts, const PrefillPlan::Item* items, int64_t n) {
  std::vector<Range> windows, blocks;
  for (int64_t i = 0; i < n; ++i) AddWindows(starts + items[i].token * s.k + items[i].k0, items[i].windows, s.r, windows);
  Merge(windows, kMergeGap);
  for (const Range& range : windows)
    for (int64_t lo = range.lo; lo < range.hi; lo += HiddenBlock(s)) blocks.push_back({lo, std::min(lo + HiddenBlock(s), range.hi)});
  return blocks;
}

// The items (indices into items[0, n), ascending) with a window reaching into rows
// [block.lo, block.hi). Single windows sorted by start reach a block in one run.
inline std::vector<int64_t> Reaching(const Sizes& s, const int64_t* starts, const PrefillPlan::Item* items, int64_t n,
                                     const Range& block) {
  std::vector<int64_t> reaching;
  for (int64_t g = 0; g < n; ++g) {
    const int64_t* first = starts + items[g].token * s.k + items[g].k0;
    if (std::any_of(first, first + items[g].windows,
                    [&](int64_t start) { return start < block.hi && start + s.r > block.lo; }))
      reaching.push_back(g);
  }
  return reaching;
}

// Whole tokens sorted by their first window, kGroupTokens a group (their other windows may lie
// anywhere: K r near H), or each window on its own, sorted by start and grouped while the starts
// lie within GroupSpread (kGroupPairs to kMostGroupPairs a group: a group reads, and converts, its rows
// once, and its blocks' runs fill the GEMM's tiles), which keeps a group's rows narrow when a
// token's windows lie apart. The cheaper of the two.
inline PrefillPlan PlanPrefill(const Sizes& s, const int64_t* starts) {
  PrefillPlan by_token, by_window;
  for (int64_t t = 0; t < s.tokens; ++t) by_token.items.push_back({t, 0, s.k});
  std::vector<int64_t> first(s.tokens);
  for (int64_t t = 0; t < s.tokens; ++t) first[t] = *std::min_element(starts + t * s.k, starts + (t + 1) * s.k);
  std::stable_sort(by_token.items.begin(), by_token.items.end(),
                   [&](const auto& a, const auto& b) { return first[a.token] < first[b.token]; });
  for (int64_t end = kGroupTokens; end - kGroupTokens < s.tokens; end += kGroupTokens)
    by_token.ends.push_back(std::min(end, s.tokens));
  if (s.k > 1) {
    for (int64_t t = 0; t < s.tokens; ++t)
      for (int64_t k = 0; k < s.k; ++k) by_window.items.push_back({t, k, 1});
    const auto start = [&](const PrefillPlan::Item& item) { return starts[item.token * s.k + item.k0]; };
    std::stable_sort(by_window.items.begin(), by_window.items.end(),
                     [&](const auto& a, const auto& b) { return start(a) < start(b); });
    const int64_t pairs = static_cast<int64_t>(by_window.items.size());
    for (int64_t begin = 0, n = 0; begin < pairs; begin += n) {
      n = std::min(kGroupPairs, pairs - begin);
      while (begin + n < pairs && n < kMostGroupPairs &&
             start(by_window.items[begin + n]) - start(by_window.items[begin]) <= GroupSpread(s))
        ++n;
      by_window.ends.push_back(begin + n);
    }
  }
  for (PrefillPlan* plan : {&by_token, &by_window}) {
    for (size_t g = 0, begin = 0; g < plan->ends.size(); begin = plan->ends[g++]) {
      const PrefillPlan::Item* items = &plan->items[begin];
      const int64_t n = plan->ends[g] - static_cast<int64_t>(begin);
      for (const Range& block : UnionBlocks(s, starts, items, n)) {
        const int64_t reaching = static_cast<int64_t>(Reaching(s, starts, items, n, block).size());
        plan->cost += (reaching + kRowCost) * (block.hi - block.lo);
      }
    }
  }
  return s.k > 1 && by_window.cost < by_token.cost ? by_window : by_token;
}

// With xq (int8 activations, whole groups of 32 columns) w_in's GEMM is integer dots
// (common/int8_dots.h: a block's rows transposed once into tiles for all the group's items);
// without, a group's activations are laid out once as columns for every block's GEMM.
template <typename T, class Format>
void Prefill(const Sizes& s, const T* x, const QuantizedTokens* xq, const int64_t* starts, const Format& w_in,
             const T* b_in, const Format& w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  // Each item adds (number of its windows covering unit i) / K times GELU over the union: summed
  // over a token's items that is c_i GELU (c_i = n_i / K), up to float rounding.
  const PrefillPlan plan = PlanPrefill(s, starts);
  const Vector bias_in = ToVector(b_in, s.h);
  const float per_window = 1.0f / static_cast<float>(s.k);
  const int64_t depth = PaddedDepth(s.d);
  RowMatrix sum = ToVector(b_out, s.d).transpose().replicate(s.tokens, 1);
  RowMatrix yg;
  std::vector<float> columns, partials;
  for (size_t group = 0, begin = 0; group < plan.ends.size(); begin = plan.ends[group++]) {
    const PrefillPlan::Item* items = &plan.items[begin];
    const int64_t n = plan.ends[group] - static_cast<int64_t>(begin);
    const std::vector<Range> blocks = UnionBlocks(s, starts, items, n);
    // Per block the items reaching into it (the others would add exact zeros), and where its
    // partial outputs lie.
    std::vector<std::vector<int64_t>> reaching(blocks.size());
    std::vector<int64_t> first_partial(blocks.size() + 1, 0);
    for (size_t index = 0; index < blocks.size(); ++index) {
      reaching[index] = Reaching(s, starts, items, n, blocks[index]);
      first_partial[index + 1] = first_partial[index] + static_cast<int64_t>(reaching[index].size());
    }
    partials.resize(first_partial.back() * depth);
    const int64_t ld = xq ? 0 : PackColumns(n, s.d, [&](int64_t g) { return x + items[g].token * s.d; }, columns);
    // One work item per block: its items' GEMM, bias, GELU and coverage, then their partial outputs.
    parallel_for(blocks.size(), [&](size_t index) {
      const int64_t lo = blocks[index].lo, hi = blocks[index].hi, rows = hi - lo;
      const std::vector<int64_t>& in = reaching[index];
      const int64_t m = static_cast<int64_t>(in.size());
      if (m == 0) return;
      RowMatrix scratch, hidden(m, rows), coverage(m, rows);
      if (xq) {
        std::vector<int64_t> ids(m);
        for (int64_t i = 0; i < m; ++i) ids[i] = items[in[i]].token;
        IntDotsOf(*xq, ids.data(), m, w_in, lo, rows, hidden.data());
      } else {
        // One run of the group's order (single windows) is read in place, others gathered.
        std::vector<float> gathered;
        const TokenTiles tiles = in.back() - in.front() + 1 == m
            ? ColumnTiles(columns, ld, in.front())
            : TilesOf(gathered = PackTokens(m, s.d, [&](int64_t i) { return x + items[in[i]].token * s.d; }), s.d);
        Gemm<true>(tiles, m, s.d, Rows(w_in, lo, hi, scratch), s.d, rows, hidden.data(), rows);
      }
      hidden.rowwise() += bias_in.segment(lo, rows).transpose();
      GeluTanh(hidden.array());
      coverage.setZero();
      for (int64_t i = 0; i < m; ++i) {  // the windows' counts (exact), then / K
        const PrefillPlan::Item& item = items[in[i]];
        float* c = coverage.row(i).data();
        for (int64_t k = 0; k < item.windows; ++k) {
          const int64_t start = starts[item.token * s.k + item.k0 + k];
          for (int64_t u = std::max(lo, start); u < std::min(hi, start + s.r); ++u) c[u - lo] += 1.0f;
        }
      }
      hidden.array() *= coverage.array() * per_window;
      // w_out's product by the batched path's axpys (common/batched.h): output columns across
      // the lanes, each sum over the block's rows in order, stored as rows of the partial.
      std::vector<float> out_scratch;
      int64_t ldw = 0;
      const float* rows_out = FloatBlock(w_out, lo, hi, out_scratch, &ldw);
      float* partial = partials.data() + first_partial[index] * depth;
      std::fill(partial, partial + m * depth, 0.0f);
      std::vector<float*> outs(m);
      for (int64_t i = 0; i < m; ++i) outs[i] = partial + i * depth;
      Axpys(hidden.data(), rows, m, rows_out, ldw, rows, depth, outs.data());
    });
    // Each item's partials added in block order (items split over the threads, a row each), then
    // each item into its token's sum in item order.
    std::vector<std::vector<int64_t>> parts(n);  // per item, its partials' rows in block order
    for (size_t index = 0; index < blocks.size(); ++index)
      for (size_t i = 0; i < reaching[index].size(); ++i)
        parts[reaching[index][i]].push_back(first_partial[index] + static_cast<int64_t>(i));
    yg.resize(n, s.d);
    parallel_for(static_cast<size_t>((n + kSumItems - 1) / kSumItems), [&](size_t chunk) {
      for (int64_t g = static_cast<int64_t>(chunk) * kSumItems; g < std::min(n, (static_cast<int64_t>(chunk) + 1) * kSumItems); ++g) {
        yg.row(g).setZero();
        for (int64_t row : parts[g]) yg.row(g) += Eigen::Map<const Eigen::RowVectorXf>(partials.data() + row * depth, s.d);
      }
    });
    for (int64_t g = 0; g < n; ++g) sum.row(items[g].token) += yg.row(g);
  }
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t j = 0; j < s.d; ++j) FromFloat(sum(t, j), y + t * s.d + j);
}

// ---- batched decode -----------------------------------------------------------------------------

// Rows per work item: fixed blocks of the hidden units, from row 0, whatever the windows, so a
// token's sums never depend on the tokens beside it.
constexpr int64_t kItemRows = 256;
// The batched path keeps a partial output per token and item: it takes at most this many tokens
// at a time (tokens x H / kItemRows x D floats), a larger call as consecutive groups of them.
constexpr int64_t kBatchedMaxTokens = 256;

// A few to a few dozen tokens: per work item, every block of kBlockRows rows is read once (as
// floats, common/batched.h) for all the tokens whose windows reach into it: their dots, bias,
// GELU and coverage, then their partial outputs. A token's output is b_out plus its partials in
// item order; rows a token's windows miss add exact zeros. With xq (int8 activations, whole
// groups of 32 columns) w_in's dots are integer ones (common/int8_dots.h), its rows never floats.
template <typename T, class Format>
void BatchedDecode(const Sizes& s, const T* x, const QuantizedTokens* xq, const int64_t* starts, const Format& w_in,
                   const T* b_in, const Format& w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  const int64_t depth = PaddedDepth(s.d), items = (s.h + kItemRows - 1) / kItemRows;
  const std::vector<float> xs = PaddedTokens(x, s.tokens, s.d);
  // w_out's product: through float blocks, or for calls of few tokens from its decode rows into
  // partials in their layout (chosen per call, never per block: a token's sums do not depend on
  // how many others share a block).
  const auto& rows_out = DecodeRows(w_out);
  using OutRows = std::decay_t<decltype(rows_out)>;
  using OutAxpy = RowsAxpy<OutRows>;
  bool in_layout = false;
  int64_t stride = depth;
  if constexpr (OutAxpy::kInLayout) {
    in_layout = s.tokens <= OutAxpy::kMostTokens;
    if (in_layout) stride = std::max(depth, DecodeLayout<OutRows>::Slots(s.d) * int64_t{OutRows::kWidth});
  }
  const auto position = [in_layout](int64_t c) {
    if constexpr (OutAxpy::kInLayout) {
      if (in_layout) return OutAxpy::Position(c);
    }
    return c;
  };
  // The tokens that reach into each item, in token order, and each token's partial there.
  std::vector<std::vector<int64_t>> tokens_of(items);
  std::vector<char> reached(items);
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::fill(reached.begin(), reached.end(), 0);
    for (int64_t j = 0; j < s.k; ++j) {
      const int64_t start = starts[t * s.k + j];
      for (int64_t item = start / kItemRows; item <= (start + s.r - 1) / kItemRows; ++item) reached[item] = 1;
    }
    for (int64_t item = 0; item < items; ++item)
      if (reached[item]) tokens_of[item].push_back(t);
  }
  std::vector<int64_t> first(items + 1, 0);
  for (int64_t item = 0; item < items; ++item) first[item + 1] = first[item] + tokens_of[item].size();
  std::vector<float> partials(first[items] * stride, 0.0f);

  parallel_for(static_cast<size_t>(items), [&](size_t item) {
    const std::vector<int64_t>& list = tokens_of[item];
    const int64_t item_lo = static_cast<int64_t>(item) * kItemRows, item_hi = std::min(item_lo + kItemRows, s.h);
    thread_local std::vector<float> scratch_in, scratch_out, hidden, coverage;
    thread_local std::vector<int64_t> covering;
    thread_local std::vector<const float*> xs_of;
    thread_local std::vector<float*> outs_of;
    for (int64_t lo = item_lo; lo < item_hi && !list.empty(); lo += kBlockRows) {
      const int64_t hi = std::min(lo + kBlockRows, item_hi), rows = hi - lo;
      // The item's tokens that cover a row of the block, and their coverage of its rows.
      covering.clear(), xs_of.clear(), outs_of.clear();
      coverage.resize(list.size() * rows);
      for (size_t g = 0; g < list.size(); ++g) {
        float* c = coverage.data() + covering.size() * rows;
        Coverage(starts + list[g] * s.k, s.k, s.r, lo, hi, c);
        if (std::any_of(c, c + rows, [](float v) { return v != 0.0f; })) {
          covering.push_back(list[g]);
          xs_of.push_back(xs.data() + list[g] * depth);
          outs_of.push_back(partials.data() + (first[item] + static_cast<int64_t>(g)) * stride);
        }
      }
      const int64_t n = static_cast<int64_t>(covering.size());
      if (n == 0) continue;
      int64_t ld = 0;
      hidden.resize(n * rows);
      if (xq) {
        IntDotsOf(*xq, covering.data(), n, w_in, lo, rows, hidden.data());
      } else {
        const float* block = FloatBlock(w_in, lo, hi, scratch_in, &ld);
        Dots(xs_of.data(), n, block, ld, rows, depth, hidden.data(), rows);
      }
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < rows; ++i) hidden[t * rows + i] += ToFloat(b_in[lo + i]);
      Eigen::Map<Eigen::ArrayXf> h(hidden.data(), n * rows);
      GeluTanh(h);
      const Eigen::Map<const Eigen::ArrayXf> c(coverage.data(), n * rows);
      h = (c != 0.0f).select(h * c, 0.0f);  // uncovered: exactly zero, whatever GELU gave
      if constexpr (OutAxpy::kInLayout) {
        if (in_layout) {
          OutAxpy::Run(rows_out, lo, rows, hidden.data(), rows, n, outs_of.data());
          continue;
        }
      }
      const float* block = FloatBlock(w_out, lo, hi, scratch_out, &ld);
      Axpys(hidden.data(), rows, n, block, ld, rows, depth, outs_of.data());
    }
  });

  std::vector<size_t> next(items, 0);  // each item's next token, in token order
  std::vector<float> sum(depth);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t c = 0; c < s.d; ++c) sum[c] = ToFloat(b_out[c]);
    for (int64_t item = 0; item < items; ++item) {
      if (next[item] == tokens_of[item].size() || tokens_of[item][next[item]] != t) continue;
      const float* partial = partials.data() + (first[item] + static_cast<int64_t>(next[item]++)) * stride;
      for (int64_t c = 0; c < s.d; ++c) sum[c] += partial[position(c)];
    }
    for (int64_t c = 0; c < s.d; ++c) FromFloat(sum[c], y + t * s.d + c);
  }
}

// One call on `path`. With int8 activations (xq) every path makes w_in's dots in integers where
// its rows are whole groups of 32 columns (read as such: d a multiple of 32); rows of a partial
// last group multiply the activations dequantized.
template <typename T, class Format>
void Compute(const Sizes& s, const T* x, const QuantizedTokens* xq, const int64_t* starts, const Format& w_in,
             const T* b_in, const Format& w_out, const T* b_out, T* y, const ParallelFor& parallel_for, Path path) {
  if (s.tokens == 0) return;
  if (path == Path::kInteger) path = Path::kGemv;  // QMatMul's own: not taken (PathFor)
  if (path == Path::kBatched && s.tokens > kBatchedMaxTokens) {
    for (int64_t begin = 0; begin < s.tokens; begin += kBatchedMaxTokens) {
      Sizes group = s;
      group.tokens = std::min(kBatchedMaxTokens, s.tokens - begin);
      const T* x_group = x + begin * s.d;
      // Quantized per token: a group's int8 activations are the call's.
      const QuantizedTokens xq_group(x_group, xq ? group.tokens : 0, s.d, xq ? xq->bits : 8);
      Compute(group, x_group, xq ? &xq_group : nullptr, starts + begin * s.k, w_in, b_in, w_out, b_out,
              y + begin * s.d, parallel_for, path);
    }
    return;
  }
  if (xq && s.d % kGroup) {
    const std::vector<T> dequantized = xq->Dequantized<T>(s.tokens, s.d);
    return Compute(s, dequantized.data(), nullptr, starts, w_in, b_in, w_out, b_out, y, parallel_for, path);
  }
  switch (path) {
    case Path::kInteger:
    case Path::kGemv: return Decode(s, x, xq, starts, w_in, b_in, w_out, b_out, y, parallel_for);
    case Path::kBatched: return BatchedDecode(s, x, xq, starts, w_in, b_in, w_out, b_out, y, parallel_for);
    case Path::kPrefill: return Prefill(s, x, xq, starts, w_in, b_in, w_out, b_out, y, parallel_for);
  }
}

// Rows of the call's matrices the path timing runs on: all of them where they hold at most
// kCalibrationWeights weights, so the windows lie as the call's will (on a few rows with windows
// scaled to the same share, a window of 256 rows of 6144 became one of 85, where the prefill
// path's blocks waste most, and the timing kept GEMV or batched where prefill is faster); else the
// first kCalibrationRows, more than a core's L2 holds, as a model's layers are. (Timed on fewer,
// held in L2, the GEMV path's reading of the rows again for every token looked cheaper than it
// is, and it kept a batch of 8 tokens from the batched path.)
constexpr int64_t kCalibrationWeights = int64_t{1} << 23;
constexpr int64_t kCalibrationRows = 8 * kItemRows;

// The path for this call (common/paths.h): with float activations GEMV for one token (streamed
// at the bytes roofline); otherwise (GEMV per token too) as timed once per process, format and
// kind of activations (kInt8), grid point by grid point as calls reach them (PathTiming), on the
// call's matrices (or their first kCalibrationRows rows), with the call's K
// and its share of them per window (r / H), the windows spread as a router spreads them: timed
// with every token on the same rows, the prefill GEMM looked faster than it is.
template <typename T, bool kInt8, class Format>
Path PathFor(const Sizes& s, const Format& w_in, const Format& w_out) {
  if (s.tokens <= 1 && !ForcedPath() && !kInt8) return Path::kGemv;
  static PathTiming timing;
  return timing.For(s.tokens, [&](PathChoice& choice, int end) {
    const int64_t most = std::min(CalibrationTokens(s.d), kPathGrid[end - 1]);
    const int64_t h = s.h * s.d <= kCalibrationWeights ? s.h : std::min(s.h, kCalibrationRows);
    const Sizes part{0, s.d, h, s.k, std::clamp<int64_t>(s.r * h / s.h, 1, h)};
    std::vector<T> x(most * s.d), b_in(h), b_out(s.d), y(most * s.d);
    for (size_t i = 0; i < x.size(); ++i) FromFloat(static_cast<float>(i % 7) * 0.25f - 0.75f, &x[i]);
    for (T& v : b_in) FromFloat(0.0f, &v);
    for (T& v : b_out) FromFloat(0.0f, &v);
    std::vector<int64_t> starts(most * s.k);
    for (size_t i = 0; i < starts.size(); ++i) starts[i] = static_cast<int64_t>(i * 2654435761u % 4294967296u) % (h - part.r + 1);
    MeasurePaths(choice, end, [&](Path path, int64_t tokens) {
      Sizes sizes = part;
      sizes.tokens = tokens;
      const QuantizedTokens xq(x.data(), kInt8 ? tokens : 0, s.d, kBitsOf<Format>);
      Compute(sizes, x.data(), kInt8 ? &xq : nullptr, starts.data(), w_in, b_in.data(), w_out, b_out.data(), y.data(),
              InlineFor(), path);
    }, [](Path path, int64_t) { return path != Path::kInteger; }, most);
  });
}


template <int Bits, typename T>
void RunBits(const Sizes& s, const Quantization& q, const T* x, const int64_t* starts, const QuantizedMatrix<T>& w_in,
             const T* b_in, const QuantizedMatrix<T>& w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  const QuantRows<Bits, T> in(w_in, s.d, q.block_size), out(w_out, s.d, q.block_size);
  if (q.int8_activations && q.block_size % kGroup == 0) {
    const QuantizedTokens xq(x, s.tokens, s.d, Bits);
    Compute(s, x, &xq, starts, in, b_in, out, b_out, y, parallel_for, PathFor<T, true>(s, in, out));
  } else {
    Compute(s, x, nullptr, starts, in, b_in, out, b_out, y, parallel_for, PathFor<T, false>(s, in, out));
  }
}

}  // namespace

// Float rows; at decode on Intel's cores streamed as IntelStreams() says.
template <typename T>
void Run(const Sizes& s, const T* x, const int64_t* starts, const T* w_in, const T* b_in,
         const T* w_out, const T* b_out, T* y, const ParallelFor& parallel_for) {
  const FloatRows<T> in{w_in, s.d}, out{w_out, s.d};
  const Path path = PathFor<T, false>(s, in, out);
  if (IntelStreams() && path == Path::kGemv) {
    Decode(s, x, nullptr, starts, FloatRows<T, true>{w_in, s.d}, b_in, FloatRows<T, true>{w_out, s.d}, b_out, y,
           parallel_for);
  } else {
    Compute(s, x, nullptr, starts, in, b_in, out, b_out, y, parallel_for, path);
  }
}

template <typename T>
void RunQuantized(const Sizes& s, const Quantization& q, const T* x, const int64_t* starts,
                  const QuantizedMatrix<T>& w_in, const T* b_in, const QuantizedMatrix<T>& w_out,
                  const T* b_out, T* y, const ParallelFor& parallel_for) {
  if (q.bits == 8) {
    RunBits<8>(s, q, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
  } else {
    RunBits<4>(s, q, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
  }
}

#define INFMOE_INSTANTIATE(T)                                                                               \
  template void Run<T>(const Sizes&, const T*, const int64_t*, const T*, const T*, const T*, const T*, T*, \
                       const ParallelFor&);                                                                \
  template void RunQuantized<T>(const Sizes&, const Quantization&, const T*, const int64_t*,               \
                                const QuantizedMatrix<T>&, const T*, const QuantizedMatrix<T>&, const T*,  \
                                T*, const ParallelFor&);
INFMOE_INSTANTIATE(float)
INFMOE_INSTANTIATE(uint16_t)
#undef INFMOE_INSTANTIATE

}  // namespace INFMOE_VARIANT
}  // namespace infmoe
