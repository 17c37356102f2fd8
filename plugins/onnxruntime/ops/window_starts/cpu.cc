// infmoe::WindowStarts (docs/reference/ops): SPEC §3's router and window starts for every
// token in one node, where its fallback function takes ten standard ops (a decode step pays
// onnxruntime's dispatch per node). A few thousand multiply-adds a token: compiled once, for the
// baseline, with no CPU variants.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/window_starts/window_starts.h"

namespace infmoe {
namespace {

constexpr int64_t kTokensPerItem = 64;  // prefill: tokens a work item takes

// x . column c of w [d, 2]: eight partial sums (independent chains), added pairwise at the end.
float Column(const float* x, const float* w, int64_t d, int c) {
  float partial[8] = {};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int j = 0; j < 8; ++j) partial[j] += x[i + j] * w[2 * (i + j) + c];
  for (; i < d; ++i) partial[i % 8] += x[i] * w[2 * i + c];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// onnxruntime's Softplus: stable on both sides.
float Softplus(float v) { return v > 0.0f ? v + std::log1p(std::exp(-v)) : std::log1p(std::exp(v)); }

}  // namespace

void WindowStarts(const RouterSizes& s, const float* x, const float* weight, const float* bias, const float* eps,
                  int64_t* starts, const ParallelFor& parallel_for) {
  const float positions = static_cast<float>(s.h - s.r + 1), last = static_cast<float>(s.h - s.r);
  auto tokens = [&](size_t item) {
    const int64_t first = static_cast<int64_t>(item) * kTokensPerItem;
    for (int64_t t = first; t < std::min(first + kTokensPerItem, s.tokens); ++t) {
      const float mu = Column(x + t * s.d, weight, s.d, 0) + bias[0];
      const float sigma = Softplus(Column(x + t * s.d, weight, s.d, 1) + bias[1]);
      const float* e = eps + (s.eps_per_token ? t * s.k : 0);
      for (int64_t k = 0; k < s.k; ++k) {
        // The fallback's ops in its order: Sigmoid, Mul, Clip (max H - r), Cast (truncation: the
        // floor of a value >= 0). NaN becomes what x86's conversion gives, INT64_MIN, which the
        // expert op refuses.
        const float z = mu + sigma * e[k];
        const float start = std::min(1.0f / (1.0f + std::exp(-z)) * positions, last);
        starts[t * s.k + k] = std::isnan(start) ? std::numeric_limits<int64_t>::min() : static_cast<int64_t>(start);
      }
    }
  };
  parallel_for(static_cast<size_t>((s.tokens + kTokensPerItem - 1) / kTokensPerItem), tokens);
}

}  // namespace infmoe
