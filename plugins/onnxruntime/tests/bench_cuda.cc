// Batch-1 decode of the CUDA computation (src/continuous_slice_ffn.cu) on a GPT-2-Small-size
// layer (D 768, H 6144, r 1536), K = 1, 2, 8, float32 and float16: achieved bandwidth against the
// GPU's device-to-device copy, measured in the same run, rounds interleaved. Two timings per call:
// launched one by one from the host ("launched", as an execution provider without CUDA graphs runs
// it: host-side launch costs included), and replayed from a CUDA graph of the same calls ("graph",
// the device's time).
//
//   infmoe_cuda_bench        (built by cross_test.sh cuda; needs a CUDA GPU)
//
// Bytes a call must read: the union of its windows' rows of w_in and w_out, b_in over those rows,
// x, b_out and y (benchmarks.triton_kernel's count, so the two compare). Copy bandwidth counts the
// bytes read and written. The weights are kept in enough copies, used in turn, that every call
// reads them from HBM, not from the L2 the previous call filled.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/continuous_slice_ffn/cuda.h"

namespace {

constexpr int64_t kD = 768, kH = 6144, kR = 1536;
constexpr int kCalls = 100, kRounds = 7;

void Check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

template <typename T>
T* Upload(const std::vector<float>& values) {
  std::vector<T> typed(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if constexpr (sizeof(T) == 2) {
      const __half h = __float2half(values[i]);
      typed[i] = *reinterpret_cast<const uint16_t*>(&h);
    } else {
      typed[i] = values[i];
    }
  }
  T* device = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&device), typed.size() * sizeof(T)), "malloc");
  Check(cudaMemcpy(device, typed.data(), typed.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return device;
}

// Milliseconds per call of fn(0..calls-1) on `stream`, timed between two events.
template <typename Fn>
double Milliseconds(cudaStream_t stream, int calls, const Fn& fn) {
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin), "event");
  Check(cudaEventCreate(&end), "event");
  Check(cudaEventRecord(begin, stream), "event");
  for (int i = 0; i < calls; ++i) fn(i);
  Check(cudaEventRecord(end, stream), "event");
  Check(cudaEventSynchronize(end), "event");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, begin, end), "event");
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return ms / calls;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One (K, precision) row: its starts, the bytes a call reads, and the weights' copies.
struct Layer {
  int k;
  bool half;
  std::vector<int64_t> starts;
  double bytes;
  std::vector<void*> w_in, w_out;
  void *x, *b_in, *b_out, *y;
  int64_t* d_starts;

  void Call(int i, cudaStream_t stream) const {
    const infmoe::Sizes s{1, kD, kH, k, kR};
    const size_t c = static_cast<size_t>(i) % w_in.size();
    if (half) {
      infmoe::cuda::ContinuousSliceFFN<uint16_t>(
          s, static_cast<const uint16_t*>(x), d_starts, static_cast<const uint16_t*>(w_in[c]),
          static_cast<const uint16_t*>(b_in), static_cast<const uint16_t*>(w_out[c]),
          static_cast<const uint16_t*>(b_out), static_cast<uint16_t*>(y), stream);
    } else {
      infmoe::cuda::ContinuousSliceFFN<float>(s, static_cast<const float*>(x), d_starts,
                                              static_cast<const float*>(w_in[c]), static_cast<const float*>(b_in),
                                              static_cast<const float*>(w_out[c]), static_cast<const float*>(b_out),
                                              static_cast<float*>(y), stream);
    }
  }
};

template <typename T>
Layer MakeLayer(int k, std::mt19937_64& rng, size_t copies) {
  std::normal_distribution<float> normal;
  auto random = [&](int64_t n, float scale) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& value : v) value = normal(rng) * scale;
    return v;
  };
  Layer layer{k, sizeof(T) == 2, {}, 0.0, {}, {}, nullptr, nullptr, nullptr, nullptr, nullptr};
  std::uniform_int_distribution<int64_t> start(0, kH - kR);
  std::vector<char> covered(kH, 0);
  for (int w = 0; w < k; ++w) {
    layer.starts.push_back(start(rng));
    std::fill(covered.begin() + layer.starts.back(), covered.begin() + layer.starts.back() + kR, 1);
  }
  const double rows = static_cast<double>(std::count(covered.begin(), covered.end(), 1));
  layer.bytes = (rows * (2 * kD + 1) + 3 * kD) * sizeof(T);
  const auto w_in = random(kH * kD, 1.0f / 28), w_out = random(kH * kD, 1.0f / 78);
  for (size_t c = 0; c < copies; ++c) {
    layer.w_in.push_back(Upload<T>(w_in));
    layer.w_out.push_back(Upload<T>(w_out));
  }
  layer.x = Upload<T>(random(kD, 1));
  layer.b_in = Upload<T>(random(kH, 0.5f));
  layer.b_out = Upload<T>(random(kD, 0.5f));
  layer.y = Upload<T>(std::vector<float>(kD));
  Check(cudaMalloc(reinterpret_cast<void**>(&layer.d_starts), k * sizeof(int64_t)), "malloc");
  Check(cudaMemcpy(layer.d_starts, layer.starts.data(), k * sizeof(int64_t), cudaMemcpyHostToDevice), "upload");
  return layer;
}

}  // namespace

int main() {
  try {
    cudaDeviceProp device;
    Check(cudaGetDeviceProperties(&device, 0), "no CUDA device");
    // Copies of the weights so that a round of kCalls calls reads at least 4x the L2 between
    // two uses of one copy.
    const double weight_bytes = 2.0 * kH * kD * 2;  // float16's, the smaller
    const size_t copies = static_cast<size_t>(4.0 * device.l2CacheSize / weight_bytes) + 2;
    std::mt19937_64 rng(20261204);
    std::vector<Layer> layers;
    for (int k : {1, 2, 8}) layers.push_back(MakeLayer<float>(k, rng, copies));
    for (int k : {1, 2, 8}) layers.push_back(MakeLayer<uint16_t>(k, rng, copies));

    const size_t copy_bytes = size_t{1} << 30;
    void *source, *target;
    Check(cudaMalloc(&source, copy_bytes), "malloc");
    Check(cudaMalloc(&target, copy_bytes), "malloc");
    Check(cudaMemset(source, 1, copy_bytes), "memset");
    cudaStream_t stream;
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    // Each layer's kCalls calls captured once into a graph.
    std::vector<cudaGraphExec_t> graphs;
    for (const Layer& layer : layers) {
      cudaGraph_t graph;
      Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
      for (int i = 0; i < kCalls; ++i) layer.Call(i, stream);
      Check(cudaStreamEndCapture(stream, &graph), "capture");
      graphs.emplace_back();
      Check(cudaGraphInstantiate(&graphs.back(), graph, 0), "graph");
    }
    std::vector<double> copy_ms;
    std::vector<std::vector<double>> launched_ms(layers.size()), graph_ms(layers.size());
    for (int round = 0; round < kRounds; ++round) {  // round 0 warms up
      const double ms = Milliseconds(stream, 10, [&](int) {
        Check(cudaMemcpyAsync(target, source, copy_bytes, cudaMemcpyDeviceToDevice, stream), "copy");
      });
      if (round > 0) copy_ms.push_back(ms);
      for (size_t l = 0; l < layers.size(); ++l) {
        const double launched = Milliseconds(stream, kCalls, [&](int i) { layers[l].Call(i, stream); });
        const double replayed = Milliseconds(stream, 1, [&](int) { Check(cudaGraphLaunch(graphs[l], stream), "replay"); });
        if (round > 0) launched_ms[l].push_back(launched), graph_ms[l].push_back(replayed / kCalls);
      }
    }
    Check(cudaStreamSynchronize(stream), "run");
    const double copy_gbs = 2.0 * copy_bytes / Median(copy_ms) / 1e6;
    std::printf("%s (capability %d.%d, L2 %d MB): copy bandwidth %.0f GB/s; layer D %lld, H %lld, r %lld; one token, "
                "%zu weight copies, median of %d rounds of %d calls\n",
                device.name, device.major, device.minor, device.l2CacheSize >> 20, copy_gbs,
                static_cast<long long>(kD), static_cast<long long>(kH), static_cast<long long>(kR), copies,
                kRounds - 1, kCalls);
    std::printf("%-5s %2s %8s %12s %10s %7s %10s %7s\n", "dtype", "K", "MB read", "launched us", "GB/s", "% copy",
                "graph us", "% copy");
    for (size_t l = 0; l < layers.size(); ++l) {
      const double launched = Median(launched_ms[l]), replayed = Median(graph_ms[l]);
      const double gbs = layers[l].bytes / launched / 1e6, graph_gbs = layers[l].bytes / replayed / 1e6;
      std::printf("%-5s %2d %8.2f %12.2f %10.0f %6.1f%% %10.2f %6.1f%%\n", layers[l].half ? "fp16" : "fp32",
                  layers[l].k, layers[l].bytes / 1e6, launched * 1e3, gbs, 100 * gbs / copy_gbs, replayed * 1e3,
                  100 * graph_gbs / copy_gbs);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "infmoe_cuda_bench: %s\n", error.what());
    return 1;
  }
  return 0;
}
