// Test driver for the CPU computation (src/continuous_slice_ffn.h) without onnxruntime: reads
// the cases written by write_reference.py (the PyTorch reference) and checks, per case,
//   valid:   float32 within 1e-5 of max|Y|, float16 within 2e-3 of max|Y|, and bit-identical
//            results with 1 thread and with 3 threads;
//   invalid: CheckStarts refuses the starts, naming the first bad index.
// Prints one line per case and a summary; exit status 0 only when every case passes.
//
//   infmoe_ffn_test CASES.bin       (INFMOE_CPU_VARIANT=baseline|avx2|avx512 picks a narrower variant)
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "continuous_slice_ffn.h"

namespace {

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
  template <typename T>
  std::vector<T> Array(int64_t n) {
    std::vector<T> v(static_cast<size_t>(n));
    Bytes(v.data(), sizeof(T) * v.size());
    return v;
  }
};

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

std::vector<uint16_t> ToHalf(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Eigen::numext::bit_cast<uint16_t>(Eigen::half(v[i]));
  return out;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// max |a - b| (NaN counts as infinite).
double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    m = std::isnan(d) ? INFINITY : std::max(m, d);
  }
  return m;
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
    if (std::memcmp(magic, "INFMOE01", 8) != 0) throw std::runtime_error("not a reference file (bad magic)");
    const int64_t cases = in.Int();
    std::printf("driver: %lld cases, CPU variant %s\n", static_cast<long long>(cases), infmoe::CpuVariant());
    for (int64_t c = 0; c < cases; ++c, ++count) {
      char name_bytes[33] = {};
      in.Bytes(name_bytes, 32);
      const std::string name(name_bytes);
      const int64_t valid = in.Int(), bad = in.Int();
      infmoe::Sizes s;
      s.tokens = in.Int(), s.d = in.Int(), s.h = in.Int(), s.k = in.Int(), s.r = in.Int();
      const auto starts = in.Array<int64_t>(s.tokens * s.k);
      const auto x = in.Array<float>(s.tokens * s.d), w_in = in.Array<float>(s.h * s.d);
      const auto b_in = in.Array<float>(s.h), w_out = in.Array<float>(s.h * s.d), b_out = in.Array<float>(s.d);
      char shape[160];
      std::snprintf(shape, sizeof shape, "tokens %lld D %lld H %lld K %lld r %lld", static_cast<long long>(s.tokens),
                    static_cast<long long>(s.d), static_cast<long long>(s.h), static_cast<long long>(s.k),
                    static_cast<long long>(s.r));
      const std::string problem = infmoe::CheckStarts(starts.data(), s);
      if (!valid) {
        const std::string expected = "starts[" + std::to_string(bad) + "] = ";
        const bool ok = problem.rfind(expected, 0) == 0;
        failures += !ok;
        std::printf("%s %-18s %s: refused: %s\n", ok ? "ok  " : "FAIL", name.c_str(), shape,
                    problem.empty() ? "(accepted!)" : problem.c_str());
        continue;
      }
      const auto y_ref = in.Array<float>(s.tokens * s.d), y16_ref = in.Array<float>(s.tokens * s.d);
      if (!problem.empty()) {
        ++failures;
        std::printf("FAIL %-18s %s: valid starts refused: %s\n", name.c_str(), shape, problem.c_str());
        continue;
      }
      std::vector<float> y(y_ref.size(), NAN), y_threads(y_ref.size(), NAN);
      infmoe::ContinuousSliceFFN<float>(s, x.data(), starts.data(), w_in.data(), b_in.data(), w_out.data(),
                                        b_out.data(), y.data(), Serial);
      infmoe::ContinuousSliceFFN<float>(s, x.data(), starts.data(), w_in.data(), b_in.data(), w_out.data(),
                                        b_out.data(), y_threads.data(), Threaded);
      const auto h_x = ToHalf(x), h_w_in = ToHalf(w_in), h_b_in = ToHalf(b_in), h_w_out = ToHalf(w_out),
                 h_b_out = ToHalf(b_out);
      std::vector<uint16_t> y16_bits(y_ref.size());
      infmoe::ContinuousSliceFFN<uint16_t>(s, h_x.data(), starts.data(), h_w_in.data(), h_b_in.data(),
                                           h_w_out.data(), h_b_out.data(), y16_bits.data(), Threaded);
      std::vector<float> y16(y16_bits.size());
      for (size_t i = 0; i < y16.size(); ++i) y16[i] = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(y16_bits[i]));

      const double scale = std::max(MaxAbs(y_ref), 1e-6f), scale16 = std::max(MaxAbs(y16_ref), 1e-6f);
      const double err = MaxDiff(y, y_ref) / scale, err16 = MaxDiff(y16, y16_ref) / scale16;
      const bool identical = std::memcmp(y.data(), y_threads.data(), y.size() * sizeof(float)) == 0;
      const bool ok = err <= 1e-5 && err16 <= 2e-3 && identical;
      failures += !ok;
      std::printf("%s %-18s %s: fp32 err %.1e, fp16 err %.1e of max|Y| %.3g, 1 vs 3 threads %s\n", ok ? "ok  " : "FAIL",
                  name.c_str(), shape, err, err16, scale, identical ? "identical" : "DIFFER");
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "driver: %s\n", error.what());
    return 2;
  }
  std::printf("driver: %d of %d cases passed (variant %s)\n", count - failures, count, infmoe::CpuVariant());
  return failures == 0 ? 0 : 1;
}
