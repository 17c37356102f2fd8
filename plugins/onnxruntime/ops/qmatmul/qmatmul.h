// The CPU computation of infmoe::QMatMul (README.md beside this file).
#pragma once

#include "common/kernel.h"

namespace infmoe {

// infmoe::QMatMul (docs/reference/ops): y[t, j] = x[t, :] . w'[j, :] for a quantized
// [n, k] matrix stored as above, each row padded to whole blocks (com.microsoft MatMulNBits'
// layout: packed [n, blocks * block_size * bits / 8], pad values q = 0). The same
// decode (few tokens) and prefill paths, every row's sum in a fixed order: bitwise identical for
// any number of threads. Preconditions (checked by the caller): shapes agree, bits 4 or 8,
// block_size a power of two >= 16.
struct MatMulSizes {
  int64_t tokens, k, n;
};
template <typename T>
void QMatMul(const MatMulSizes& sizes, const Quantization& quantization, const T* x, const QuantizedMatrix<T>& w,
             T* y, const ParallelFor& parallel_for);

}  // namespace infmoe
