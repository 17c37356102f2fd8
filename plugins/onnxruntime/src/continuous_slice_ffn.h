// The CPU computation of infmoe::ContinuousSliceFFN (SPEC §3-4), free of onnxruntime types so
// that the op glue (custom_op.cc) only validates, allocates and hands over a thread pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace infmoe {

// Sizes after flattening X to [tokens, d] and starts to [tokens, k]; w_in, w_out are [h, d].
struct Sizes {
  int64_t tokens, d, h, k, r;
};

// Runs body(i) for every i in [0, n), possibly in parallel (onnxruntime's intra-op pool).
// Results never depend on how the calls are spread over threads.
using ParallelFor = std::function<void(size_t n, const std::function<void(size_t)>& body)>;

// Element types: float, or IEEE half stored as uint16_t (computed in float).
// Preconditions (checked by the caller): shapes agree, 1 <= r <= h, every start in [0, h - r].
template <typename T>
void ContinuousSliceFFN(const Sizes& sizes, const T* x, const int64_t* starts, const T* w_in,
                        const T* b_in, const T* w_out, const T* b_out, T* y,
                        const ParallelFor& parallel_for);

}  // namespace infmoe
