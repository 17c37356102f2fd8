// The CPU computation of infmoe::DecoderAttention (README.md beside this file).
#pragma once

#include "common/kernel.h"

namespace infmoe {

// infmoe::DecoderAttention (docs/reference/ops): causal multi-head attention over a KV
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
// The cache (past and present alike) holds C: float, or uint16_t for float16 (keys and values read
// as float; the new ones rounded to float16 as they are written, then read back like the rest).
template <typename C>
void DecoderAttention(const AttentionSizes& sizes, const float* qkv, const C* past_key, const C* past_value,
                      const int32_t* seqlens_k, const float* attention_bias, const float* qkv_bias, float* y,
                      C* present_key, C* present_value, const ParallelFor& parallel_for);

}  // namespace infmoe
