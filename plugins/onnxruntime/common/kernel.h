// What every op's CPU computation shares, free of onnxruntime types: the op glue (ops/*/op.cc)
// validates, allocates and hands over a thread pool; the test driver (tests/driver.cc) calls the
// computations directly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace infmoe {

// Runs body(i) for every i in [0, n), possibly in parallel (onnxruntime's intra-op pool).
// Results never depend on how the calls are spread over threads.
using ParallelFor = std::function<void(size_t n, const std::function<void(size_t)>& body)>;

// A ParallelFor on the calling thread, i in order: for calls too small to wake the pool, and for
// the path timing (common/paths.h), which times one thread's arithmetic.
inline const ParallelFor& InlineFor() {
  static const ParallelFor inline_for = [](size_t n, const std::function<void(size_t)>& body) {
    for (size_t i = 0; i < n; ++i) body(i);
  };
  return inline_for;
}

// The quantized weights of QContinuousSliceFFN and QMatMul (SPEC §6): `bits`-bit integers (uint8
// storage, offset 2^(bits-1); int4: two per byte, even column in the low nibble) with one scale
// of type T per block of block_size columns of a row.
// int8_activations: the integer dots of common/int8_dots.h (session option infmoe.activations =
// int8), where the weights allow them (block_size a multiple of 32); else float activations
// (SPEC §6 level 1).
struct Quantization {
  int64_t bits, block_size;
  bool int8_activations = false;
};
template <typename T>
struct QuantizedMatrix {
  const uint8_t* packed;
  const T* scale;
};

// The compiled variant the ops run on this CPU: "avx512", "avx2" or "baseline"
// (x86-64), "baseline" elsewhere. Chosen once, at the first call, with __builtin_cpu_supports;
// the environment variable INFMOE_CPU_VARIANT can ask for a narrower one (tests, benchmarks),
// never for one the CPU lacks.
const char* CpuVariant();

}  // namespace infmoe
