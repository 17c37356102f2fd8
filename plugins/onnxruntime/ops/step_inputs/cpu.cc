// infmoe::StepInputs (docs/reference/ops): the onnxruntime target's once-per-step inputs
// in one node, where its fallback function takes thirteen standard ops (a decode step pays
// onnxruntime's dispatch per node). A pass over the mask: compiled once, for the baseline.
#include <limits>

#include "ops/step_inputs/step_inputs.h"

namespace infmoe {

void StepInputs(const StepSizes& s, const int64_t* mask, int64_t* position_ids, int32_t* seqlens_k,
                float* attention_bias) {
  const int64_t first = s.total - s.sequence;  // the step's tokens: the mask's last columns
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t* row = mask + b * s.total;
    // The exclusive cumulative sum, wrapping as onnxruntime's int64 CumSum does, and the last
    // index of its maximum (ArgMax with select_last_index).
    uint64_t count = 0;
    int64_t largest = 0, last_largest = 0;
    for (int64_t j = 0; j < s.total; ++j) {
      const auto before = static_cast<int64_t>(count);
      if (j == 0 || before >= largest) largest = before, last_largest = j;
      if (j >= first) position_ids[b * s.sequence + j - first] = before;
      count += static_cast<uint64_t>(row[j]);
    }
    seqlens_k[b] = static_cast<int32_t>(last_largest);
    for (int64_t i = 0; i < s.sequence; ++i) {
      float* bias = attention_bias + (b * s.sequence + i) * s.total;
      for (int64_t j = 0; j < s.total; ++j) bias[j] = row[j] != 0 ? 0.0f : std::numeric_limits<float>::lowest();
    }
  }
}

}  // namespace infmoe
