// Run-time choice of the CPU variant of the kernel (compiled for the portable baseline: this
// file must not use any instruction beyond it). continuous_slice_ffn.cc is compiled once per
// variant, into namespace infmoe::<variant>; CMakeLists.txt says which variants exist
// (INFMOE_HAVE_AVX2, INFMOE_HAVE_AVX512) and why their code cannot leak into one another.
#include <cstdlib>
#include <cstring>

#include "continuous_slice_ffn.h"

#define INFMOE_DECLARE_VARIANT(name)                                                                    \
  namespace name {                                                                                      \
  template <typename T>                                                                                 \
  void Run(const Sizes&, const T*, const int64_t*, const T*, const T*, const T*, const T*, T*,          \
           const ParallelFor&);                                                                         \
  extern template void Run<float>(const Sizes&, const float*, const int64_t*, const float*,            \
                                  const float*, const float*, const float*, float*,                   \
                                  const ParallelFor&);                                                \
  extern template void Run<uint16_t>(const Sizes&, const uint16_t*, const int64_t*, const uint16_t*,   \
                                     const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,     \
                                     const ParallelFor&);                                             \
  }

namespace infmoe {

INFMOE_DECLARE_VARIANT(baseline)
#ifdef INFMOE_HAVE_AVX2
INFMOE_DECLARE_VARIANT(avx2)
#endif
#ifdef INFMOE_HAVE_AVX512
INFMOE_DECLARE_VARIANT(avx512)
#endif

namespace {

template <typename T>
using Kernel = void (*)(const Sizes&, const T*, const int64_t*, const T*, const T*, const T*, const T*, T*,
                        const ParallelFor&);

struct Variant {
  const char* name;
  Kernel<float> f32;
  Kernel<uint16_t> f16;
};

// Widest first. x86-64-v3 is AVX2 + FMA + F16C + BMI1/2 + LZCNT + MOVBE, x86-64-v4 adds
// AVX-512 F/BW/CD/DQ/VL: exactly the -march levels the variants are compiled for. libgcc's
// check includes the OS's support for the wider registers (XGETBV).
Variant Choose() {
  const Variant variants[] = {
#ifdef INFMOE_HAVE_AVX512
      {"avx512", avx512::Run<float>, avx512::Run<uint16_t>},
#endif
#ifdef INFMOE_HAVE_AVX2
      {"avx2", avx2::Run<float>, avx2::Run<uint16_t>},
#endif
      {"baseline", baseline::Run<float>, baseline::Run<uint16_t>},
  };
  auto supported = [](const char* name) {
#if defined(__x86_64__) && (defined(INFMOE_HAVE_AVX2) || defined(INFMOE_HAVE_AVX512))
    __builtin_cpu_init();
    if (std::strcmp(name, "avx512") == 0) return __builtin_cpu_supports("x86-64-v4") != 0;
    if (std::strcmp(name, "avx2") == 0) return __builtin_cpu_supports("x86-64-v3") != 0;
#endif
    return std::strcmp(name, "baseline") == 0;
  };
  // INFMOE_CPU_VARIANT may ask for a narrower variant (tests, benchmarks), never an unsupported one.
  const char* wanted = std::getenv("INFMOE_CPU_VARIANT");
  const Variant* best = nullptr;
  for (const Variant& variant : variants) {
    if (!supported(variant.name)) continue;
    if (best == nullptr) best = &variant;
    if (wanted != nullptr && std::strcmp(wanted, variant.name) == 0) return variant;
  }
  return *best;  // baseline is always supported
}

const Variant& Chosen() {
  static const Variant variant = Choose();  // thread-safe, once per process
  return variant;
}

template <typename T>
Kernel<T> KernelOf(const Variant& v);
template <>
Kernel<float> KernelOf<float>(const Variant& v) { return v.f32; }
template <>
Kernel<uint16_t> KernelOf<uint16_t>(const Variant& v) { return v.f16; }

}  // namespace

const char* CpuVariant() { return Chosen().name; }

std::string CheckStarts(const int64_t* starts, const Sizes& s) {
  const int64_t last = s.h - s.r;
  for (int64_t i = 0; i < s.tokens * s.k; ++i) {
    if (starts[i] < 0 || starts[i] > last) {
      return "starts[" + std::to_string(i) + "] = " + std::to_string(starts[i]) + " is outside [0, " +
             std::to_string(last) + "] (H = " + std::to_string(s.h) + ", slice_width = " + std::to_string(s.r) + ")";
    }
  }
  return {};
}

template <typename T>
void ContinuousSliceFFN(const Sizes& sizes, const T* x, const int64_t* starts, const T* w_in,
                        const T* b_in, const T* w_out, const T* b_out, T* y,
                        const ParallelFor& parallel_for) {
  KernelOf<T>(Chosen())(sizes, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
}

template void ContinuousSliceFFN<float>(const Sizes&, const float*, const int64_t*, const float*,
                                        const float*, const float*, const float*, float*,
                                        const ParallelFor&);
template void ContinuousSliceFFN<uint16_t>(const Sizes&, const uint16_t*, const int64_t*,
                                           const uint16_t*, const uint16_t*, const uint16_t*,
                                           const uint16_t*, uint16_t*, const ParallelFor&);

}  // namespace infmoe
