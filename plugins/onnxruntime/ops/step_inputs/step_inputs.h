// The CPU computation of infmoe::StepInputs (README.md beside this file).
#pragma once

#include "common/kernel.h"

namespace infmoe {

// infmoe::StepInputs (docs/reference/ops): the onnxruntime target's once-per-step inputs
// from attention_mask [batch, total] (int64) for a step of `sequence` tokens. Per row, counts = the
// mask's exclusive cumulative sum: position_ids [batch, sequence] = its last `sequence` values,
// seqlens_k [batch] = the last index of its largest value (total - 1 for a mask of 0 and 1);
// attention_bias [batch, 1, sequence, total] = 0 where the mask is nonzero, float32's lowest
// elsewhere, every query alike. Preconditions (checked by the caller): sequence <= total.
struct StepSizes {
  int64_t batch, sequence, total;
};
void StepInputs(const StepSizes& sizes, const int64_t* mask, int64_t* position_ids, int32_t* seqlens_k,
                float* attention_bias);

}  // namespace infmoe
