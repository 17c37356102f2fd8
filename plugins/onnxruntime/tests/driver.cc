// Test driver for the CPU computations (src/continuous_slice_ffn.h) without onnxruntime: reads
// the cases written by write_reference.py (expected results from the Python references) and
// checks, per case, with the Python tests' tolerances (relative to max|reference|):
//   ffn:     ContinuousSliceFFN, fp32 within 1e-5, fp16 within 2e-3;
//   refuse:  CheckStarts refuses the starts, naming the first bad index;
//   qffn:    QContinuousSliceFFN (int8 / int4, fp32 / fp16) within 1e-5 / 2e-3 of the level-1 reference;
//   qmatmul: QMatMul (int8 / int4, fp32 / fp16) within 1e-5 / 2e-3;
//   attn:    DecoderAttention's y within 1e-5, present_key / present_value exactly as expected
//            (a separate buffer, or past's own: then only the new positions change);
//   starts:  WindowStarts exact, but for starts whose float64 value lies within a hair of an
//            integer (marked by the writer): those within one;
//   steps:   StepInputs exact;
//   norm:    SkipLayerNorm's sum exact, its output within 2e-5 (epsilon 1e-5, as the writer's);
// and every computation bit-identical with 1 thread and with 3 threads. Built with the CUDA
// kernel (cross_test.sh cuda), ffn cases also run the CUDA computation on the GPU, within the same
// tolerances and bit-identical across two runs; no CUDA device is then a failure.
// Prints one line per case and a summary; exit status 0 only when every case passes.
//
//   infmoe_ffn_test CASES.bin       (INFMOE_CPU_VARIANT=baseline|avx2|avx512 picks a narrower variant)
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/continuous_slice_ffn/continuous_slice_ffn.h"
#include "ops/decoder_attention/decoder_attention.h"
#include "ops/qmatmul/qmatmul.h"
#include "ops/skip_layer_norm/skip_layer_norm.h"
#include "ops/step_inputs/step_inputs.h"
#include "ops/window_starts/window_starts.h"
#ifdef INFMOE_DRIVER_CUDA
#include <cuda_runtime.h>

#include "ops/continuous_slice_ffn/cuda.h"
#endif

namespace {

// ---- the reference file -------------------------------------------------------------------------

template <typename T> const char* TypeName();  // numpy's type string of T's arrays
template <> const char* TypeName<float>() { return "<f4"; }
template <> const char* TypeName<uint16_t>() { return "<f2"; }  // IEEE half
template <> const char* TypeName<double>() { return "<f8"; }
template <> const char* TypeName<int64_t>() { return "<i8"; }
template <> const char* TypeName<int32_t>() { return "<i4"; }
template <> const char* TypeName<uint8_t>() { return "|u1"; }

struct Array {
  std::string type;
  int64_t count;
  std::vector<char> bytes;
};

// One case: its name, kind, sizes (write_reference.py's SIZES) and arrays (its ARRAYS).
struct Case {
  std::string name, kind;
  std::vector<int64_t> sizes;
  std::vector<Array> arrays;

  int64_t Size(size_t i) const {
    if (i >= sizes.size()) throw std::runtime_error(name + ": too few sizes");
    return sizes[i];
  }
  const Array& At(size_t i, int64_t count) const {
    if (i >= arrays.size()) throw std::runtime_error(name + ": too few arrays");
    if (arrays[i].count != count) {
      throw std::runtime_error(name + ": array " + std::to_string(i) + " holds " + std::to_string(arrays[i].count) +
                               " values, expected " + std::to_string(count));
    }
    return arrays[i];
  }
  // Array i as T (its type must be T's), `count` values.
  template <typename T>
  const T* Get(size_t i, int64_t count) const {
    const Array& a = At(i, count);
    if (a.type != TypeName<T>()) throw std::runtime_error(name + ": array " + std::to_string(i) + " is " + a.type);
    return reinterpret_cast<const T*>(a.bytes.data());
  }
  const std::string& Type(size_t i) const { return arrays.at(i).type; }
  bool Half(size_t i) const { return Type(i) == TypeName<uint16_t>(); }  // else float
};

struct Reader {
  std::ifstream in;
  explicit Reader(const char* path) : in(path, std::ios::binary) {
    if (!in) throw std::runtime_error(std::string("cannot open ") + path);
  }
  void Bytes(void* dst, size_t n) {
    if (!in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n))) throw std::runtime_error("truncated file");
  }
  int64_t Int() {
    int64_t v;
    Bytes(&v, sizeof v);
    return v;
  }
  std::string Text(size_t n) {
    std::string s(n, '\0');
    Bytes(&s[0], n);
    return s.c_str();  // up to the first NUL
  }
  Case Next() {
    Case c;
    c.name = Text(32), c.kind = Text(8);
    c.sizes.resize(static_cast<size_t>(Int()));
    for (auto& size : c.sizes) size = Int();
    c.arrays.resize(static_cast<size_t>(Int()));
    for (auto& a : c.arrays) {
      a.type = Text(4), a.count = Int();
      const size_t width = a.type.empty() ? 0 : static_cast<size_t>(std::atoi(a.type.c_str() + 2));
      if (width == 0 || a.count < 0) throw std::runtime_error(c.name + ": bad array header");
      a.bytes.resize(width * static_cast<size_t>(a.count));
      Bytes(a.bytes.data(), a.bytes.size());
    }
    return c;
  }
};

// ---- running and comparing ----------------------------------------------------------------------

void Serial(size_t n, const std::function<void(size_t)>& body) {
  for (size_t i = 0; i < n; ++i) body(i);
}

// Three threads taking work items round robin: a different split from Serial.
void Threaded(size_t n, const std::function<void(size_t)>& body) {
  std::vector<std::thread> threads;
  for (size_t t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < n; i += 3) body(i);
    });
  }
  for (auto& thread : threads) thread.join();
}

// run(parallel_for) -> the outputs, with Serial and with Threaded: Serial's, and whether the two
// are bit-identical.
template <typename T, typename Run>
std::vector<T> RunBoth(const Run& run, bool* identical) {
  const std::vector<T> serial = run(infmoe::ParallelFor(Serial)), threaded = run(infmoe::ParallelFor(Threaded));
  *identical = serial.size() == threaded.size() &&
               std::memcmp(serial.data(), threaded.data(), serial.size() * sizeof(T)) == 0;
  return serial;
}

uint16_t ToHalf(float v) { return Eigen::numext::bit_cast<uint16_t>(Eigen::half(v)); }
double ToDouble(float v) { return v; }
double ToDouble(double v) { return v; }
double ToDouble(uint16_t v) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(v)); }

template <typename T>
std::vector<T> Filled(size_t n) {  // outputs start as NaN: a value never written shows
  if constexpr (std::is_same_v<T, uint16_t>) return std::vector<T>(n, 0x7e00);  // half NaN
  else return std::vector<T>(n, NAN);
}

// Any floating-point array (of the file or an output) as doubles.
template <typename T>
std::vector<double> Doubles(const T* v, size_t n) {
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = ToDouble(v[i]);
  return out;
}
std::vector<double> Doubles(const Case& c, size_t i, int64_t count) {
  const std::string& type = c.Type(i);
  if (type == "<f4") return Doubles(c.Get<float>(i, count), static_cast<size_t>(count));
  if (type == "<f8") return Doubles(c.Get<double>(i, count), static_cast<size_t>(count));
  return Doubles(c.Get<uint16_t>(i, count), static_cast<size_t>(count));
}

// max |y - ref| / max |ref| (tests/test_ort_kernel.py's relative_error; NaN counts as infinite).
double RelativeError(const std::vector<double>& y, const std::vector<double>& ref) {
  double diff = 0.0, scale = 1e-6;  // no values: 0
  for (size_t i = 0; i < y.size(); ++i) {
    const double d = std::fabs(y[i] - ref[i]);
    diff = std::isnan(d) ? INFINITY : std::max(diff, d);
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return diff / scale;
}

struct Result {
  bool ok;
  std::string shape, detail;
};

std::string Shape(std::initializer_list<std::pair<const char*, int64_t>> sizes) {
  std::string s;
  for (const auto& [name, value] : sizes) s += (s.empty() ? "" : " ") + std::string(name) + " " + std::to_string(value);
  return s;
}

std::string Format(const char* format, double a, double b = 0.0) {
  char text[96];
  std::snprintf(text, sizeof text, format, a, b);
  return text;
}

const char* ThreadsText(bool identical) { return identical ? "1 vs 3 threads identical" : "1 vs 3 threads DIFFER"; }

// ---- the kinds of case --------------------------------------------------------------------------

infmoe::Sizes FfnSizes(const Case& c) { return {c.Size(0), c.Size(1), c.Size(2), c.Size(3), c.Size(4)}; }

std::string FfnShape(const infmoe::Sizes& s) {
  return Shape({{"tokens", s.tokens}, {"D", s.d}, {"H", s.h}, {"K", s.k}, {"r", s.r}});
}

// The same values given to the op in float and in half (ContinuousSliceFFN<T>).
template <typename T>
std::vector<T> Ffn(const infmoe::Sizes& s, const std::vector<std::vector<T>>& in, const int64_t* starts, bool* identical) {
  return RunBoth<T>([&](const infmoe::ParallelFor& parallel_for) {
    auto y = Filled<T>(static_cast<size_t>(s.tokens * s.d));
    infmoe::ContinuousSliceFFN<T>(s, in[0].data(), starts, in[1].data(), in[2].data(), in[3].data(), in[4].data(),
                                  y.data(), parallel_for);
    return y;
  }, identical);
}

#ifdef INFMOE_DRIVER_CUDA
void CudaCheck(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string("CUDA ") + what + ": " + cudaGetErrorString(status));
}

// A host array's copy in device memory.
template <typename T>
struct DeviceArray {
  T* data = nullptr;
  explicit DeviceArray(const std::vector<T>& host) {
    CudaCheck(cudaMalloc(reinterpret_cast<void**>(&data), std::max<size_t>(1, host.size()) * sizeof(T)), "malloc");
    CudaCheck(cudaMemcpy(data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "copy to device");
  }
  DeviceArray(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data); }
};

// The CUDA computation on the same inputs, on the default stream, run twice: the first run's
// outputs, and whether the second's are bit-identical.
template <typename T>
std::vector<T> CudaFfn(const infmoe::Sizes& s, const std::vector<std::vector<T>>& in, const int64_t* starts,
                       bool* identical) {
  const DeviceArray<int64_t> d_starts(std::vector<int64_t>(starts, starts + s.tokens * s.k));
  const DeviceArray<T> x(in[0]), w_in(in[1]), b_in(in[2]), w_out(in[3]), b_out(in[4]);
  std::vector<T> runs[2];
  for (auto& y : runs) {
    y = Filled<T>(static_cast<size_t>(s.tokens * s.d));
    const DeviceArray<T> d_y(y);
    infmoe::cuda::ContinuousSliceFFN<T>(s, x.data, d_starts.data, w_in.data, b_in.data, w_out.data, b_out.data,
                                        d_y.data, nullptr);
    CudaCheck(cudaMemcpy(y.data(), d_y.data, y.size() * sizeof(T), cudaMemcpyDeviceToHost), "copy to host");
  }
  *identical = runs[0] == runs[1];
  return runs[0];
}
#endif

// starts x w_in b_in w_out b_out | y y16
Result CheckFfn(const Case& c) {
  const infmoe::Sizes s = FfnSizes(c);
  const int64_t* starts = c.Get<int64_t>(0, s.tokens * s.k);
  const int64_t counts[] = {s.tokens * s.d, s.h * s.d, s.h, s.h * s.d, s.d};
  std::vector<std::vector<float>> in;
  std::vector<std::vector<uint16_t>> in16;
  for (size_t i = 0; i < 5; ++i) {
    const float* v = c.Get<float>(i + 1, counts[i]);
    in.emplace_back(v, v + counts[i]);
    in16.emplace_back(counts[i]);
    std::transform(v, v + counts[i], in16.back().begin(), ToHalf);
  }
  const std::string problem = infmoe::CheckStarts(starts, s);
  if (!problem.empty()) return {false, FfnShape(s), "valid starts refused: " + problem};
  bool identical, identical16;
  const auto y = Ffn(s, in, starts, &identical);
  const auto y16 = Ffn(s, in16, starts, &identical16);
  const size_t n = y.size();
  const double err = RelativeError(Doubles(y.data(), n), Doubles(c, 6, s.tokens * s.d));
  const double err16 = RelativeError(Doubles(y16.data(), n), Doubles(c, 7, s.tokens * s.d));
  Result result{err <= 1e-5 && err16 <= 2e-3 && identical && identical16, FfnShape(s),
                Format("fp32 err %.1e, fp16 err %.1e, ", err, err16) + ThreadsText(identical && identical16)};
#ifdef INFMOE_DRIVER_CUDA
  bool cuda_identical, cuda_identical16;
  const auto cuda_y = CudaFfn(s, in, starts, &cuda_identical);
  const auto cuda_y16 = CudaFfn(s, in16, starts, &cuda_identical16);
  const double cuda_err = RelativeError(Doubles(cuda_y.data(), n), Doubles(c, 6, s.tokens * s.d));
  const double cuda_err16 = RelativeError(Doubles(cuda_y16.data(), n), Doubles(c, 7, s.tokens * s.d));
  result.ok = result.ok && cuda_err <= 1e-5 && cuda_err16 <= 2e-3 && cuda_identical && cuda_identical16;
  result.detail += Format("; CUDA fp32 err %.1e, fp16 err %.1e, ", cuda_err, cuda_err16) +
                   (cuda_identical && cuda_identical16 ? "2 runs identical" : "2 runs DIFFER");
#endif
  return result;
}

// starts; sizes end with the first bad index
Result CheckRefusal(const Case& c) {
  const infmoe::Sizes s = FfnSizes(c);
  const std::string problem = infmoe::CheckStarts(c.Get<int64_t>(0, s.tokens * s.k), s);
  const bool ok = problem.rfind("starts[" + std::to_string(c.Size(5)) + "] = ", 0) == 0;
  return {ok, FfnShape(s), "refused: " + (problem.empty() ? std::string("(accepted!)") : problem)};
}

template <typename T>
const char* ActivationName() { return sizeof(T) == 4 ? "fp32" : "fp16"; }
template <typename T>
double Tolerance() { return sizeof(T) == 4 ? 1e-5 : 2e-3; }

// y of a quantized op against the case's array `ref`, within T's tolerance and the same with 1
// and 3 threads.
template <typename T>
Result Judged(const std::vector<T>& y, const Case& c, size_t ref, bool identical, const std::string& shape) {
  const double err = RelativeError(Doubles(y.data(), y.size()), Doubles(c, ref, static_cast<int64_t>(y.size())));
  return {err <= Tolerance<T>() && identical, shape, Format("err %.1e (tolerance %.0e), ", err, Tolerance<T>()) +
                                                         ThreadsText(identical)};
}

// starts x w_in_q w_in_scale b_in w_out_q w_out_scale b_out | y; T: x's type
template <typename T>
Result CheckQffn(const Case& c) {
  const infmoe::Quantization q{c.Size(0), c.Size(1)};
  const infmoe::Sizes s{c.Size(2), c.Size(3), c.Size(4), c.Size(5), c.Size(6)};
  const int64_t columns = q.bits == 8 ? s.d : (s.d + 1) / 2, blocks = (s.d + q.block_size - 1) / q.block_size;
  const int64_t* starts = c.Get<int64_t>(0, s.tokens * s.k);
  const T* x = c.Get<T>(1, s.tokens * s.d);
  const infmoe::QuantizedMatrix<T> w_in{c.Get<uint8_t>(2, s.h * columns), c.Get<T>(3, s.h * blocks)};
  const infmoe::QuantizedMatrix<T> w_out{c.Get<uint8_t>(5, s.h * columns), c.Get<T>(6, s.h * blocks)};
  const T *b_in = c.Get<T>(4, s.h), *b_out = c.Get<T>(7, s.d);
  const std::string shape = "int" + std::to_string(q.bits) + " " + ActivationName<T>() + " " +
                            Shape({{"B", q.block_size}}) + " " + FfnShape(s);
  const std::string problem = infmoe::CheckStarts(starts, s);
  if (!problem.empty()) return {false, shape, "valid starts refused: " + problem};
  bool identical;
  const auto y = RunBoth<T>([&](const infmoe::ParallelFor& parallel_for) {
    auto out = Filled<T>(static_cast<size_t>(s.tokens * s.d));
    infmoe::QContinuousSliceFFN<T>(s, q, x, starts, w_in, b_in, w_out, b_out, out.data(), parallel_for);
    return out;
  }, &identical);
  return Judged(y, c, 8, identical, shape);
}

// a b scales | y; T: a's type
template <typename T>
Result CheckQMatMul(const Case& c) {
  const infmoe::Quantization q{c.Size(0), c.Size(1)};
  const infmoe::MatMulSizes s{c.Size(2), c.Size(3), c.Size(4)};
  const int64_t blocks = (s.k + q.block_size - 1) / q.block_size;
  const T* a = c.Get<T>(0, s.tokens * s.k);
  const infmoe::QuantizedMatrix<T> w{c.Get<uint8_t>(1, s.n * blocks * q.block_size * q.bits / 8),
                                     c.Get<T>(2, s.n * blocks)};
  const std::string shape = "int" + std::to_string(q.bits) + " " + ActivationName<T>() + " " +
                            Shape({{"B", q.block_size}, {"tokens", s.tokens}, {"K", s.k}, {"N", s.n}});
  bool identical;
  const auto y = RunBoth<T>([&](const infmoe::ParallelFor& parallel_for) {
    auto out = Filled<T>(static_cast<size_t>(s.tokens * s.n));
    infmoe::QMatMul<T>(s, q, a, w, out.data(), parallel_for);
    return out;
  }, &identical);
  return Judged(y, c, 3, identical, shape);
}

// qkv past_key past_value seqlens_k bias qkv_bias | y present_key present_value
Result CheckAttention(const Case& c) {
  infmoe::AttentionSizes s{c.Size(0), c.Size(1), c.Size(2), c.Size(3), c.Size(4), 0, c.Size(5), false};
  const int64_t bias_rows = c.Size(6);
  const bool shared = c.Size(7) != 0, with_qkv_bias = c.Size(8) != 0;
  s.present = std::max(s.past, s.total);
  s.bias_batch = bias_rows == s.batch && s.batch != 1;
  const size_t ny = static_cast<size_t>(s.batch * s.sequence * s.heads * s.head_dim);
  const size_t past = static_cast<size_t>(s.batch * s.heads * s.past * s.head_dim);
  const size_t present = static_cast<size_t>(s.batch * s.heads * s.present * s.head_dim);
  if (shared && present != past) throw std::runtime_error(c.name + ": a shared buffer needs total <= past");
  const float* qkv = c.Get<float>(0, static_cast<int64_t>(ny) * 3);
  const float *past_key = c.Get<float>(1, past), *past_value = c.Get<float>(2, past);
  const int32_t* seqlens_k = c.Get<int32_t>(3, s.batch);
  const float* bias = c.Get<float>(4, bias_rows * s.sequence * s.total);
  const float* qkv_bias = with_qkv_bias ? c.Get<float>(5, 3 * s.heads * s.head_dim) : nullptr;
  const std::string shape = Shape({{"batch", s.batch}, {"sequence", s.sequence}, {"heads", s.heads},
                                   {"head_dim", s.head_dim}, {"past", s.past}, {"total", s.total}}) +
                            " seqlens_k " + std::to_string(seqlens_k[0]) +
                            (s.batch > 1 ? "," + std::to_string(seqlens_k[1]) : "") +
                            (shared ? " present = past" : " present apart") + (with_qkv_bias ? ", qkv bias" : "");
  // y, present_key and present_value in one buffer; shared: the two caches start as past's values.
  bool identical;
  const auto out = RunBoth<float>([&](const infmoe::ParallelFor& parallel_for) {
    auto buffer = Filled<float>(ny + 2 * present);
    float *key = buffer.data() + ny, *value = key + present;
    if (shared) {
      std::copy(past_key, past_key + past, key);
      std::copy(past_value, past_value + past, value);
    }
    infmoe::DecoderAttention(s, qkv, shared ? key : past_key, shared ? value : past_value, seqlens_k, bias, qkv_bias,
                             buffer.data(), key, value, parallel_for);
    return buffer;
  }, &identical);
  const double err = RelativeError(Doubles(out.data(), ny), Doubles(c, 6, ny));
  const float *key_ref = c.Get<float>(7, present), *value_ref = c.Get<float>(8, present);
  const bool cache = std::memcmp(out.data() + ny, key_ref, present * sizeof(float)) == 0 &&
                     std::memcmp(out.data() + ny + present, value_ref, present * sizeof(float)) == 0;
  return {err <= 1e-5 && cache && identical, shape,
          Format("y err %.1e, ", err) + (cache ? "present exact, " : "present WRONG, ") + ThreadsText(identical)};
}

// x weight bias eps | starts near
Result CheckWindowStarts(const Case& c) {
  const infmoe::RouterSizes s{c.Size(0), c.Size(1), c.Size(2), c.Size(3), c.Size(4), c.Size(5) != 0};
  const size_t n = static_cast<size_t>(s.tokens * s.k);
  const float* x = c.Get<float>(0, s.tokens * s.d);
  const float *weight = c.Get<float>(1, s.d * 2), *bias = c.Get<float>(2, 2);
  const float* eps = c.Get<float>(3, s.eps_per_token ? s.tokens * s.k : s.k);
  const int64_t* expected = c.Get<int64_t>(4, n);
  const uint8_t* near = c.Get<uint8_t>(5, n);
  bool identical;
  const auto starts = RunBoth<int64_t>([&](const infmoe::ParallelFor& parallel_for) {
    std::vector<int64_t> out(n, -1);
    infmoe::WindowStarts(s, x, weight, bias, eps, out.data(), parallel_for);
    return out;
  }, &identical);
  size_t wrong = 0, off_by_one = 0, near_count = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t diff = starts[i] > expected[i] ? starts[i] - expected[i] : expected[i] - starts[i];
    const bool in_range = starts[i] >= 0 && starts[i] <= s.h - s.r;
    near_count += near[i];
    off_by_one += diff == 1;
    wrong += !in_range || diff > (near[i] ? 1 : 0);
  }
  const std::string shape = Shape({{"tokens", s.tokens}, {"D", s.d}, {"K", s.k}, {"H", s.h}, {"r", s.r}}) +
                            (s.eps_per_token ? " eps per token" : " eps shared");
  return {wrong == 0 && identical, shape,
          std::to_string(n) + " starts, " + std::to_string(wrong) + " wrong, " + std::to_string(off_by_one) +
              " off by one (" + std::to_string(near_count) + " near an integer), " + ThreadsText(identical)};
}

// attention_mask | position_ids seqlens_k attention_bias
Result CheckStepInputs(const Case& c) {
  const infmoe::StepSizes s{c.Size(0), c.Size(1), c.Size(2)};
  const size_t positions = static_cast<size_t>(s.batch * s.sequence), bias = positions * static_cast<size_t>(s.total);
  std::vector<int64_t> position_ids(positions, -1);
  std::vector<int32_t> seqlens_k(static_cast<size_t>(s.batch), -1);
  std::vector<float> attention_bias(bias, 1.0f);
  infmoe::StepInputs(s, c.Get<int64_t>(0, s.batch * s.total), position_ids.data(), seqlens_k.data(), attention_bias.data());
  const bool exact = std::memcmp(position_ids.data(), c.Get<int64_t>(1, positions), positions * sizeof(int64_t)) == 0 &&
                     std::memcmp(seqlens_k.data(), c.Get<int32_t>(2, s.batch), seqlens_k.size() * sizeof(int32_t)) == 0 &&
                     std::memcmp(attention_bias.data(), c.Get<float>(3, bias), bias * sizeof(float)) == 0;
  return {exact, Shape({{"batch", s.batch}, {"sequence", s.sequence}, {"total", s.total}}),
          exact ? "positions, seqlens_k and bias exact" : "WRONG"};
}

// input skip gamma beta bias | output sum
Result CheckSkipLayerNorm(const Case& c) {
  const infmoe::NormSizes s{c.Size(0), c.Size(1)};
  const bool with_bias = c.Size(2) != 0;
  const size_t n = static_cast<size_t>(s.rows * s.d);
  const float *input = c.Get<float>(0, n), *skip = c.Get<float>(1, n), *gamma = c.Get<float>(2, s.d),
              *beta = c.Get<float>(3, s.d), *bias = with_bias ? c.Get<float>(4, s.d) : nullptr;
  bool identical;
  const auto out = RunBoth<float>([&](const infmoe::ParallelFor& parallel_for) {
    std::vector<float> both = Filled<float>(2 * n);
    infmoe::SkipLayerNorm(s, input, skip, gamma, beta, bias, 1e-5f, both.data(), both.data() + n, parallel_for);
    return both;
  }, &identical);
  const double err = RelativeError(Doubles(out.data(), n), Doubles(c, 5, static_cast<int64_t>(n)));
  const bool sum_exact = std::memcmp(out.data() + n, c.Get<float>(6, n), n * sizeof(float)) == 0;
  return {err <= 2e-5 && sum_exact && identical,
          Shape({{"rows", s.rows}, {"D", s.d}}) + (with_bias ? " bias" : " no bias"),
          Format("output err %.1e, ", err) + (sum_exact ? "sum exact, " : "sum WRONG, ") + ThreadsText(identical)};
}

Result Check(const Case& c) {
  if (c.kind == "ffn") return CheckFfn(c);
  if (c.kind == "refuse") return CheckRefusal(c);
  if (c.kind == "qffn") return c.Half(1) ? CheckQffn<uint16_t>(c) : CheckQffn<float>(c);  // by x's type
  if (c.kind == "qmatmul") return c.Half(0) ? CheckQMatMul<uint16_t>(c) : CheckQMatMul<float>(c);
  if (c.kind == "attn") return CheckAttention(c);
  if (c.kind == "starts") return CheckWindowStarts(c);
  if (c.kind == "steps") return CheckStepInputs(c);
  if (c.kind == "norm") return CheckSkipLayerNorm(c);
  throw std::runtime_error(c.name + ": unknown kind '" + c.kind + "'");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASES.bin\n", argv[0]);
    return 2;
  }
  int failures = 0, count = 0;
  try {
    Reader in(argv[1]);
    char magic[8];
    in.Bytes(magic, 8);
    if (std::memcmp(magic, "INFMOE02", 8) != 0) throw std::runtime_error("not a reference file (bad magic)");
    const int64_t cases = in.Int();
    std::printf("driver: %lld cases, CPU variant %s\n", static_cast<long long>(cases), infmoe::CpuVariant());
#ifdef INFMOE_DRIVER_CUDA
    cudaDeviceProp device;  // no device: an error (this build exists to test the GPU)
    CudaCheck(cudaGetDeviceProperties(&device, 0), "device 0");
    std::printf("driver: ffn cases also on CUDA device 0, %s (capability %d.%d)\n", device.name, device.major,
                device.minor);
#endif
    for (int64_t i = 0; i < cases; ++i, ++count) {
      const Case c = in.Next();
      const Result result = Check(c);
      failures += !result.ok;
      std::printf("%s %-7s %-25s %s: %s\n", result.ok ? "ok  " : "FAIL", c.kind.c_str(), c.name.c_str(),
                  result.shape.c_str(), result.detail.c_str());
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "driver: %s\n", error.what());
    return 2;
  }
  // A forced float streaming (the library's INFMOE_INTEL_STREAMS) is named after the variant.
  const char* streams = std::getenv("INFMOE_INTEL_STREAMS");
  std::printf("driver: %d of %d cases passed (variant %s%s%s)\n", count - failures, count, infmoe::CpuVariant(),
              streams ? ", INFMOE_INTEL_STREAMS=" : "", streams ? streams : "");
  return failures == 0 ? 0 : 1;
}
