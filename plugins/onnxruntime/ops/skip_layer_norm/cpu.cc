// infmoe::SkipLayerNorm (docs/reference/ops): the onnxruntime target's residual add and
// LayerNorm in one node. onnxruntime's own SkipLayerNormalization takes several times its memory
// traffic on the CPU at a prefill's rows (python -m benchmarks.skip_layer_norm); this is three
// vector passes over each row. Compiled once, for the baseline, with no CPU variants: four-lane
// vectors (SSE2, NEON) already keep up with a row's traffic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/skip_layer_norm/skip_layer_norm.h"

namespace infmoe {
namespace {

constexpr int64_t kRowsPerItem = 16;  // rows a work item takes (a decode step's one row: inline)
constexpr int kLanes = 4;
typedef float Quad __attribute__((vector_size(kLanes * sizeof(float))));

inline Quad Load(const float* p) {
  Quad v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, Quad v) { std::memcpy(p, &v, sizeof v); }
inline float Total(Quad a, Quad b) { return (a[0] + b[0]) + (a[1] + b[1]) + ((a[2] + b[2]) + (a[3] + b[3])); }

// One row: s = (input + skip) + bias into `sum`; m, its mean in float, then the deviations
// s - m (exact where s lies within a factor of two of m), their sum c and sum of squares q:
// the mean is m + c / d and the variance q / d - (c / d)^2 (the corrected two-pass form: a row
// far from zero loses nothing to m's rounding). Two accumulators of four lanes each, then the
// tail: the same order for every row and thread count.
void Row(int64_t d, const float* input, const float* skip, const float* gamma, const float* beta, const float* bias,
         float epsilon, float* y, float* sum) {
  const int64_t full = d / (2 * kLanes) * (2 * kLanes);
  Quad acc[2] = {};
  for (int64_t c = 0; c < full; c += 2 * kLanes) {
    for (int i = 0; i < 2; ++i) {
      const int64_t at = c + i * kLanes;
      Quad v = Load(input + at) + Load(skip + at);
      if (bias) v += Load(bias + at);
      Store(sum + at, v);
      acc[i] += v;
    }
  }
  float total = Total(acc[0], acc[1]);
  for (int64_t c = full; c < d; ++c) {
    sum[c] = input[c] + skip[c] + (bias ? bias[c] : 0.0f);
    total += sum[c];
  }
  const float n = static_cast<float>(d), m = total / n;
  Quad dev[2] = {}, sq[2] = {};
  for (int64_t c = 0; c < full; c += 2 * kLanes) {
    for (int i = 0; i < 2; ++i) {
      const Quad v = Load(sum + c + i * kLanes) - m;
      dev[i] += v;
      sq[i] += v * v;
    }
  }
  float deviation = Total(dev[0], dev[1]), squares = Total(sq[0], sq[1]);
  for (int64_t c = full; c < d; ++c) deviation += sum[c] - m, squares += (sum[c] - m) * (sum[c] - m);
  const float shift = deviation / n;
  const float scale = 1.0f / std::sqrt(std::max(squares / n - shift * shift, 0.0f) + epsilon);
  for (int64_t c = 0; c < full; c += kLanes) {
    Store(y + c, ((Load(sum + c) - m) - shift) * scale * Load(gamma + c) + Load(beta + c));
  }
  for (int64_t c = full; c < d; ++c) y[c] = ((sum[c] - m) - shift) * scale * gamma[c] + beta[c];
}

}  // namespace

void SkipLayerNorm(const NormSizes& s, const float* input, const float* skip, const float* gamma, const float* beta,
                   const float* bias, float epsilon, float* y, float* sum, const ParallelFor& parallel_for) {
  parallel_for(static_cast<size_t>((s.rows + kRowsPerItem - 1) / kRowsPerItem), [&](size_t item) {
    thread_local std::vector<float> scratch;  // the sum of a row when it is not an output
    if (!sum) scratch.resize(s.d);
    const int64_t first = static_cast<int64_t>(item) * kRowsPerItem;
    for (int64_t r = first; r < std::min(first + kRowsPerItem, s.rows); ++r) {
      const int64_t at = r * s.d;
      Row(s.d, input + at, skip + at, gamma, beta, bias, epsilon, y + at, sum ? sum + at : scratch.data());
    }
  });
}

}  // namespace infmoe
