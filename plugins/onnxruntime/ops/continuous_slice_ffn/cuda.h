// The CUDA computation of infmoe::ContinuousSliceFFN, for the CUDA execution provider.
// Compiled when nvcc is available (INFMOE_CUDA); not run in this project's CI (no GPU there).
#pragma once

#include <cstdint>

#include "ops/continuous_slice_ffn/continuous_slice_ffn.h"

namespace infmoe {
namespace cuda {

// Copies n int64 values from device to host on `stream` and waits, so starts can be checked.
void CopyToHost(const int64_t* device, int64_t n, int64_t* host, void* stream);

// Same preconditions as the CPU version; every pointer is device memory, T is float or half
// bits (uint16_t). Enqueued on `stream` (a cudaStream_t).
template <typename T>
void ContinuousSliceFFN(const Sizes& sizes, const T* x, const int64_t* starts, const T* w_in,
                        const T* b_in, const T* w_out, const T* b_out, T* y, void* stream);

}  // namespace cuda
}  // namespace infmoe
