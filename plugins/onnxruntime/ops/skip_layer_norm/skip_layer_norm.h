// The CPU computation of infmoe::SkipLayerNorm (README.md beside this file).
#pragma once

#include "common/kernel.h"

namespace infmoe {

// infmoe::SkipLayerNorm (docs/reference/ops): per row of d values, sum = (input + skip) + bias
// (bias optional), then y = (sum - mean) / sqrt(var + epsilon) * gamma + beta with the row's mean
// and (biased) variance, two passes in float. sum may be null (the output not asked for).
struct NormSizes {
  int64_t rows, d;
};
void SkipLayerNorm(const NormSizes& sizes, const float* input, const float* skip, const float* gamma, const float* beta,
                   const float* bias, float epsilon, float* y, float* sum, const ParallelFor& parallel_for);

}  // namespace infmoe
