// The CPU computation of infmoe::ContinuousSliceFFN and infmoe::QContinuousSliceFFN (SPEC §3-4, §6).
#pragma once

#include "common/kernel.h"

namespace infmoe {

// Sizes after flattening X to [tokens, d] and starts to [tokens, k]; w_in, w_out are [h, d].
struct Sizes {
  int64_t tokens, d, h, k, r;
};

// Empty when every start lies in [0, h - r]; otherwise the message naming the first that does
// not, e.g. "starts[5] = 40 is outside [0, 39] (H = 48, slice_width = 9)". Callers must check
// this (and 1 <= r <= h, k >= 1) before calling either op.
std::string CheckStarts(const int64_t* starts, const Sizes& sizes);

// Element types: float, or IEEE half stored as uint16_t (computed in float).
// Preconditions (checked by the caller): shapes agree, 1 <= r <= h, every start in [0, h - r].
// Runs the widest variant this CPU supports (see CpuVariant), as does QContinuousSliceFFN.
template <typename T>
void ContinuousSliceFFN(const Sizes& sizes, const T* x, const int64_t* starts, const T* w_in,
                        const T* b_in, const T* w_out, const T* b_out, T* y,
                        const ParallelFor& parallel_for);

// infmoe::QContinuousSliceFFN (SPEC §6): w_in and w_out quantized (common/kernel.h). Preconditions
// as above, plus: bits 4 or 8, block_size a power of two >= 16, packed [h, d or ceil(d/2)] and
// scale [h, ceil(d/block_size)].
template <typename T>
void QContinuousSliceFFN(const Sizes& sizes, const Quantization& quantization, const T* x, const int64_t* starts,
                         const QuantizedMatrix<T>& w_in, const T* b_in, const QuantizedMatrix<T>& w_out,
                         const T* b_out, T* y, const ParallelFor& parallel_for);

}  // namespace infmoe
