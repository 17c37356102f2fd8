// The CPU computation of infmoe::WindowStarts (README.md beside this file).
#pragma once

#include "common/kernel.h"

namespace infmoe {

// infmoe::WindowStarts (docs/reference/ops): per token, SPEC §3's router z_k = mu + softplus(s)
// eps_k with [mu, s] = x . weight + bias (weight [d, 2]), then starts = min(sigmoid(z) (h - r + 1),
// h - r) truncated to int64 (INT64_MIN for NaN). eps: k values shared by all tokens, or k per token.
struct RouterSizes {
  int64_t tokens, d, k, h, r;
  bool eps_per_token;
};
void WindowStarts(const RouterSizes& sizes, const float* x, const float* weight, const float* bias, const float* eps,
                  int64_t* starts, const ParallelFor& parallel_for);

}  // namespace infmoe
