// The CPU computation of infmoe::ContinuousSliceFFN (SPEC §3-4), free of onnxruntime types so
// that the op glue (custom_op.cc) only validates, allocates and hands over a thread pool, and the
// test driver (tests/driver.cc) can call it directly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace infmoe {

// Sizes after flattening X to [tokens, d] and starts to [tokens, k]; w_in, w_out are [h, d].
struct Sizes {
  int64_t tokens, d, h, k, r;
};

// Runs body(i) for every i in [0, n), possibly in parallel (onnxruntime's intra-op pool).
// Results never depend on how the calls are spread over threads.
using ParallelFor = std::function<void(size_t n, const std::function<void(size_t)>& body)>;

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

// infmoe::QContinuousSliceFFN (SPEC §6): w_in and w_out stored as `bits`-bit integers (uint8
// storage, offset 2^(bits-1); int4: two per byte, even column in the low nibble) with one scale
// of type T per block of block_size columns of a row. Preconditions as above, plus: bits 4 or 8,
// block_size a power of two >= 16, packed [h, d or ceil(d/2)] and scale [h, ceil(d/block_size)].
struct Quantization {
  int64_t bits, block_size;
};
template <typename T>
struct QuantizedMatrix {
  const uint8_t* packed;
  const T* scale;
};
template <typename T>
void QContinuousSliceFFN(const Sizes& sizes, const Quantization& quantization, const T* x, const int64_t* starts,
                         const QuantizedMatrix<T>& w_in, const T* b_in, const QuantizedMatrix<T>& w_out,
                         const T* b_out, T* y, const ParallelFor& parallel_for);

// infmoe::QMatMul (docs/onnxruntime-kernel.md): y[t, j] = x[t, :] . w'[j, :] for a quantized
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

// infmoe::DecoderAttention (docs/onnxruntime-kernel.md): causal multi-head attention over a KV
// cache, com.microsoft GroupQueryAttention's computation for a packed qkv [batch, sequence,
// 3 heads head_dim] with as many key/value heads as query heads and no rotary embedding. Row b's
// cache holds past_b = seqlens_k[b] + 1 - sequence positions; the new keys and values are written
// to present at [past_b, past_b + sequence) (present may be past's own buffer: then nothing else
// is written; otherwise row b's past_b positions are copied and the rest zeroed). y [batch, sequence, heads head_dim].
// qkv_bias [3 heads head_dim] (or null) is added to every token's qkv first, as a separate Add would.
// Preconditions (checked by the caller): 0 <= past_b <= past, seqlens_k[b] + 1 <= total <= present.
struct AttentionSizes {
  int64_t batch, sequence, heads, head_dim;
  int64_t past;     // positions of past_key / past_value (0: none)
  int64_t present;  // positions of present_key / present_value: max(past, total)
  int64_t total;    // total_sequence_length: attention_bias [1 or batch, 1, sequence, total]
  bool bias_batch;  // attention_bias has a row per batch row (else one, broadcast)
};
void DecoderAttention(const AttentionSizes& sizes, const float* qkv, const float* past_key, const float* past_value,
                      const int32_t* seqlens_k, const float* attention_bias, const float* qkv_bias, float* y,
                      float* present_key, float* present_value, const ParallelFor& parallel_for);

// infmoe::WindowStarts (docs/onnxruntime-kernel.md): per token, SPEC §3's router z_k = mu + softplus(s)
// eps_k with [mu, s] = x . weight + bias (weight [d, 2]), then starts = min(sigmoid(z) (h - r + 1),
// h - r) truncated to int64 (INT64_MIN for NaN). eps: k values shared by all tokens, or k per token.
struct RouterSizes {
  int64_t tokens, d, k, h, r;
  bool eps_per_token;
};
void WindowStarts(const RouterSizes& sizes, const float* x, const float* weight, const float* bias, const float* eps,
                  int64_t* starts, const ParallelFor& parallel_for);

// infmoe::StepInputs (docs/onnxruntime-kernel.md): the onnxruntime target's once-per-step inputs
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

// The compiled variant ContinuousSliceFFN runs on this CPU: "avx512", "avx2" or "baseline"
// (x86-64), "baseline" elsewhere. Chosen once, at the first call, with __builtin_cpu_supports;
// the environment variable INFMOE_CPU_VARIANT can ask for a narrower one (tests, benchmarks),
// never for one the CPU lacks.
const char* CpuVariant();

}  // namespace infmoe
