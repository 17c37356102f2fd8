// Run-time choice of the CPU variant of the kernel (compiled for the portable baseline: this
// file must not use any instruction beyond it). continuous_slice_ffn.cc is compiled once per
// variant, into namespace infmoe::<variant>; CMakeLists.txt says which variants exist
// (INFMOE_HAVE_AVX2, INFMOE_HAVE_AVX512) and why their code cannot leak into one another.
#include <cstdlib>
#include <cstring>

#include "ops/continuous_slice_ffn/continuous_slice_ffn.h"
#include "ops/decoder_attention/decoder_attention.h"
#include "ops/qmatmul/qmatmul.h"

#define INFMOE_DECLARE_RUN(T)                                                                            \
  extern template void Run<T>(const Sizes&, const T*, const int64_t*, const T*, const T*, const T*, const T*, \
                              T*, const ParallelFor&);                                                      \
  extern template void RunQuantized<T>(const Sizes&, const Quantization&, const T*, const int64_t*,          \
                                       const QuantizedMatrix<T>&, const T*, const QuantizedMatrix<T>&,       \
                                       const T*, T*, const ParallelFor&);                                   \
  extern template void RunQMatMul<T>(const MatMulSizes&, const Quantization&, const T*, const QuantizedMatrix<T>&, \
                                     T*, const ParallelFor&);
#define INFMOE_DECLARE_VARIANT(name)                                                                      \
  namespace name {                                                                                        \
  template <typename T>                                                                                   \
  void Run(const Sizes&, const T*, const int64_t*, const T*, const T*, const T*, const T*, T*,            \
           const ParallelFor&);                                                                           \
  template <typename T>                                                                                   \
  void RunQuantized(const Sizes&, const Quantization&, const T*, const int64_t*, const QuantizedMatrix<T>&, \
                    const T*, const QuantizedMatrix<T>&, const T*, T*, const ParallelFor&);               \
  template <typename T>                                                                                   \
  void RunQMatMul(const MatMulSizes&, const Quantization&, const T*, const QuantizedMatrix<T>&, T*,       \
                  const ParallelFor&);                                                                    \
  template <typename C>                                                                                   \
  void RunAttention(const AttentionSizes&, const float*, const C*, const C*, const int32_t*, const float*, \
                    const float*, float*, C*, C*, const ParallelFor&);                                    \
  INFMOE_DECLARE_RUN(float)                                                                               \
  INFMOE_DECLARE_RUN(uint16_t)                                                                            \
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
template <typename T>
using QKernel = void (*)(const Sizes&, const Quantization&, const T*, const int64_t*, const QuantizedMatrix<T>&,
                         const T*, const QuantizedMatrix<T>&, const T*, T*, const ParallelFor&);
template <typename T>
using MatMulKernel = void (*)(const MatMulSizes&, const Quantization&, const T*, const QuantizedMatrix<T>&, T*,
                              const ParallelFor&);

template <typename C>
using AttentionKernel = void (*)(const AttentionSizes&, const float*, const C*, const C*, const int32_t*,
                                 const float*, const float*, float*, C*, C*, const ParallelFor&);

struct Variant {
  const char* name;
  Kernel<float> f32;
  Kernel<uint16_t> f16;
  QKernel<float> q32;
  QKernel<uint16_t> q16;
  MatMulKernel<float> mm32;
  MatMulKernel<uint16_t> mm16;
  AttentionKernel<float> attention32;
  AttentionKernel<uint16_t> attention16;
};

#define INFMOE_VARIANT_ENTRY(name)                                                                        \
  {#name, name::Run<float>, name::Run<uint16_t>, name::RunQuantized<float>, name::RunQuantized<uint16_t>, \
   name::RunQMatMul<float>, name::RunQMatMul<uint16_t>, name::RunAttention<float>, name::RunAttention<uint16_t>}

// Widest first. x86-64-v3 is AVX2 + FMA + F16C + BMI1/2 + LZCNT + MOVBE, x86-64-v4 adds
// AVX-512 F/BW/CD/DQ/VL; the avx512 variant also uses AVX512-VNNI (a Skylake-X without it runs
// avx2): exactly the flags the variants are compiled with. libgcc's
// check includes the OS's support for the wider registers (XGETBV).
Variant Choose() {
  const Variant variants[] = {
#ifdef INFMOE_HAVE_AVX512
      INFMOE_VARIANT_ENTRY(avx512),
#endif
#ifdef INFMOE_HAVE_AVX2
      INFMOE_VARIANT_ENTRY(avx2),
#endif
      INFMOE_VARIANT_ENTRY(baseline),
  };
  auto supported = [](const char* name) {
#if defined(__x86_64__) && (defined(INFMOE_HAVE_AVX2) || defined(INFMOE_HAVE_AVX512))
    __builtin_cpu_init();
    if (std::strcmp(name, "avx512") == 0)
      return __builtin_cpu_supports("x86-64-v4") != 0 && __builtin_cpu_supports("avx512vnni") != 0;
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

// The chosen variant's kernels for element type T.
template <typename T>
struct KernelsOf;
template <>
struct KernelsOf<float> {
  static Kernel<float> Float(const Variant& v) { return v.f32; }
  static QKernel<float> Quantized(const Variant& v) { return v.q32; }
  static MatMulKernel<float> MatMul(const Variant& v) { return v.mm32; }
};
template <>
struct KernelsOf<uint16_t> {
  static Kernel<uint16_t> Float(const Variant& v) { return v.f16; }
  static QKernel<uint16_t> Quantized(const Variant& v) { return v.q16; }
  static MatMulKernel<uint16_t> MatMul(const Variant& v) { return v.mm16; }
};

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
  KernelsOf<T>::Float(Chosen())(sizes, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
}

template void ContinuousSliceFFN<float>(const Sizes&, const float*, const int64_t*, const float*,
                                        const float*, const float*, const float*, float*,
                                        const ParallelFor&);
template void ContinuousSliceFFN<uint16_t>(const Sizes&, const uint16_t*, const int64_t*,
                                           const uint16_t*, const uint16_t*, const uint16_t*,
                                           const uint16_t*, uint16_t*, const ParallelFor&);

template <typename T>
void QContinuousSliceFFN(const Sizes& sizes, const Quantization& quantization, const T* x, const int64_t* starts,
                         const QuantizedMatrix<T>& w_in, const T* b_in, const QuantizedMatrix<T>& w_out,
                         const T* b_out, T* y, const ParallelFor& parallel_for) {
  KernelsOf<T>::Quantized(Chosen())(sizes, quantization, x, starts, w_in, b_in, w_out, b_out, y, parallel_for);
}

template void QContinuousSliceFFN<float>(const Sizes&, const Quantization&, const float*, const int64_t*,
                                         const QuantizedMatrix<float>&, const float*, const QuantizedMatrix<float>&,
                                         const float*, float*, const ParallelFor&);
template void QContinuousSliceFFN<uint16_t>(const Sizes&, const Quantization&, const uint16_t*, const int64_t*,
                                            const QuantizedMatrix<uint16_t>&, const uint16_t*,
                                            const QuantizedMatrix<uint16_t>&, const uint16_t*, uint16_t*,
                                            const ParallelFor&);

template <typename T>
void QMatMul(const MatMulSizes& sizes, const Quantization& quantization, const T* x, const QuantizedMatrix<T>& w,
             T* y, const ParallelFor& parallel_for) {
  KernelsOf<T>::MatMul(Chosen())(sizes, quantization, x, w, y, parallel_for);
}

template void QMatMul<float>(const MatMulSizes&, const Quantization&, const float*, const QuantizedMatrix<float>&,
                             float*, const ParallelFor&);
template void QMatMul<uint16_t>(const MatMulSizes&, const Quantization&, const uint16_t*,
                                const QuantizedMatrix<uint16_t>&, uint16_t*, const ParallelFor&);

template <typename C>
void DecoderAttention(const AttentionSizes& sizes, const float* qkv, const C* past_key, const C* past_value,
                      const int32_t* seqlens_k, const float* attention_bias, const float* qkv_bias, float* y,
                      C* present_key, C* present_value, const ParallelFor& parallel_for) {
  const auto attention = [&] {
    if constexpr (std::is_same_v<C, float>) return Chosen().attention32;
    else return Chosen().attention16;
  }();
  attention(sizes, qkv, past_key, past_value, seqlens_k, attention_bias, qkv_bias, y, present_key, present_value,
            parallel_for);
}

template void DecoderAttention<float>(const AttentionSizes&, const float*, const float*, const float*, const int32_t*,
                                      const float*, const float*, float*, float*, float*, const ParallelFor&);
template void DecoderAttention<uint16_t>(const AttentionSizes&, const float*, const uint16_t*, const uint16_t*,
                                         const int32_t*, const float*, const float*, float*, uint16_t*, uint16_t*,
                                         const ParallelFor&);

}  // namespace infmoe
