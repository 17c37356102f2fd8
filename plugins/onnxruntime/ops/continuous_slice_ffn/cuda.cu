// CUDA kernels for infmoe::ContinuousSliceFFN: one pass for the hidden units, one for the output
// (in chunks of rows, then a sum of the chunks). Both skip every unit no window of the token covers,
// so a token reads only its union of rows; every sum has a fixed order, so results are
// deterministic. Aimed at decode (memory bound); prefill re-reads the weights per token.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "ops/continuous_slice_ffn/cuda.h"

namespace infmoe {
namespace cuda {
namespace {

void Check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA ") + what + ": " + cudaGetErrorString(status));
  }
}

__device__ inline float Load(const float* p, int64_t i) { return p[i]; }
__device__ inline float Load(const uint16_t* p, int64_t i) {
  return __half2float(reinterpret_cast<const __half*>(p)[i]);
}
__device__ inline void Store(float* p, int64_t i, float v) { p[i] = v; }
__device__ inline void Store(uint16_t* p, int64_t i, float v) { reinterpret_cast<__half*>(p)[i] = __float2half(v); }

// (number of the token's windows covering unit i) / k. Form (docs/reference/spec.md §6.3): a per-unit
// count over the K windows, one thread per unit, divided by k once.
__device__ inline float Coverage(const int64_t* starts, int64_t k, int64_t r, int64_t i) {
  int count = 0;
  for (int64_t j = 0; j < k; ++j) count += (starts[j] <= i && i < starts[j] + r);
  return static_cast<float>(count) / static_cast<float>(k);
}

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kColumnsPerBlock = 256;

// hidden[t, i] = coverage * gelu_tanh(x_t . w_in[i] + b_in[i]); one warp per (token, unit).
// Tokens stride over grid.y (at most 65535 blocks).
template <typename T>
__global__ void HiddenKernel(Sizes s, const T* x, const int64_t* starts, const T* w_in, const T* b_in,
                             float* hidden) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= s.h) return;  // whole warps: the shuffles below always see 32 lanes
  for (int64_t t = blockIdx.y; t < s.tokens; t += gridDim.y) {
    const float c = Coverage(starts + t * s.k, s.k, s.r, i);
    float* out = hidden + t * s.h + i;
    if (c == 0.0f) {
      if (lane == 0) *out = 0.0f;
      continue;
    }
    float sum = 0.0f;
#pragma unroll 8
    for (int64_t j = lane; j < s.d; j += kWarp) sum += Load(x, t * s.d + j) * Load(w_in, i * s.d + j);
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (lane == 0) {
      const float a = sum + Load(b_in, i);
      *out = c * 0.5f * a * (1.0f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a)));
    }
  }
}

// Output rows are summed in chunks, so that one decode token spreads its w_out rows over enough
// blocks to keep the memory busy (one block per column strip would leave almost every
// multiprocessor idle). Many tokens supply the blocks themselves: one chunk, no partial sums.
constexpr int64_t kChunkRows = 32;
constexpr int64_t kMaxPartialRows = 256;  // chunks x tokens, so the partial sums stay small

int64_t Chunks(const Sizes& s) {
  const int64_t most = (s.h + kChunkRows - 1) / kChunkRows;
  const int64_t fit = s.tokens < kMaxPartialRows ? kMaxPartialRows / s.tokens : 1;
  return most < fit ? most : fit;
}

// sum_i hidden[t, i] * w_out[i, j] over the chunk's rows of the token's span; one thread per
// (column, chunk, token). One chunk: y = b_out + sum; else the sum goes to partial[chunk, t, j].
// Tokens stride over grid.z (at most 65535 blocks).
template <typename T>
__global__ void OutputKernel(Sizes s, int64_t chunk_rows, const int64_t* starts, const float* hidden,
                             const T* w_out, const T* b_out, T* y, float* partial) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  if (j >= s.d) return;
  const int64_t chunk = blockIdx.y;
  for (int64_t t = blockIdx.z; t < s.tokens; t += gridDim.z) {
    const int64_t* own = starts + t * s.k;
    int64_t lo = own[0], hi = own[0] + s.r;
    for (int64_t w = 1; w < s.k; ++w) {
      lo = min(lo, own[w]);
      hi = max(hi, own[w] + s.r);
    }
    const int64_t begin = max(lo, chunk * chunk_rows), end = min(hi, (chunk + 1) * chunk_rows);
    float sum = 0.0f;
#pragma unroll 8
    for (int64_t i = begin; i < end; ++i) {
      const float h = hidden[t * s.h + i];
      if (h != 0.0f) sum += h * Load(w_out, i * s.d + j);  // uncovered units are exactly 0
    }
    if (gridDim.y == 1) {
      Store(y, t * s.d + j, Load(b_out, j) + sum);
    } else {
      partial[(chunk * s.tokens + t) * s.d + j] = sum;
    }
  }
}

// y[t, j] = b_out[j] + the chunks' partial sums; one warp per (token, column): lane l adds
// chunks l, l + 32, ... in order, then the lanes' sums meet in a fixed tree (deterministic).
template <typename T>
__global__ void SumChunksKernel(Sizes s, int64_t chunks, const float* partial, const T* b_out, T* y) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (e >= s.tokens * s.d) return;  // whole warps
  float sum = 0.0f;
  for (int64_t c = lane; c < chunks; c += kWarp) sum += partial[c * s.tokens * s.d + e];
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (lane == 0) Store(y, e, Load(b_out, e % s.d) + sum);
}

}  // namespace

void CopyToHost(const int64_t* device, int64_t n, int64_t* host, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  Check(cudaMemcpyAsync(host, device, n * sizeof(int64_t), cudaMemcpyDeviceToHost, s), "copy of starts");
  Check(cudaStreamSynchronize(s), "copy of starts");
}

template <typename T>
void ContinuousSliceFFN(const Sizes& s, const T* x, const int64_t* starts, const T* w_in,
                        const T* b_in, const T* w_out, const T* b_out, T* y, void* stream) {
  if (s.tokens == 0 || s.d == 0) return;
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const int64_t chunks = Chunks(s);
  const int64_t hidden_count = s.tokens * s.h, partial_count = chunks > 1 ? chunks * s.tokens * s.d : 0;
  float* hidden = nullptr;
  Check(cudaMallocAsync(reinterpret_cast<void**>(&hidden), (hidden_count + partial_count) * sizeof(float), cuda_stream),
        "allocation");
  float* partial = hidden + hidden_count;
  const unsigned grid_tokens = static_cast<unsigned>(s.tokens < 65535 ? s.tokens : 65535);
  const dim3 hidden_grid(static_cast<unsigned>((s.h + kWarpsPerBlock - 1) / kWarpsPerBlock), grid_tokens);
  HiddenKernel<T><<<hidden_grid, kWarpsPerBlock * kWarp, 0, cuda_stream>>>(s, x, starts, w_in, b_in, hidden);
  const dim3 output_grid(static_cast<unsigned>((s.d + kColumnsPerBlock - 1) / kColumnsPerBlock),
                         static_cast<unsigned>(chunks), grid_tokens);
  const int64_t chunk_rows = (s.h + chunks - 1) / chunks;
  OutputKernel<T><<<output_grid, kColumnsPerBlock, 0, cuda_stream>>>(s, chunk_rows, starts, hidden, w_out, b_out, y,
                                                                     partial);
  if (chunks > 1) {
    const auto sum_blocks = static_cast<unsigned>((s.tokens * s.d + kWarpsPerBlock - 1) / kWarpsPerBlock);
    SumChunksKernel<T><<<sum_blocks, kWarpsPerBlock * kWarp, 0, cuda_stream>>>(s, chunks, partial, b_out, y);
  }
  Check(cudaGetLastError(), "kernel launch");
  Check(cudaFreeAsync(hidden, cuda_stream), "free");
}

template void ContinuousSliceFFN<float>(const Sizes&, const float*, const int64_t*, const float*,
                                        const float*, const float*, const float*, float*, void*);
template void ContinuousSliceFFN<uint16_t>(const Sizes&, const uint16_t*, const int64_t*,
                                           const uint16_t*, const uint16_t*, const uint16_t*,
                                           const uint16_t*, uint16_t*, void*);

}  // namespace cuda
}  // namespace infmoe
