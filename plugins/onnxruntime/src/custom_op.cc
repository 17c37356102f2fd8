// onnxruntime glue for infmoe::ContinuousSliceFFN v1 (SPEC §4): attribute and shape checks,
// output allocation, the intra-op thread pool, and the RegisterCustomOps entry point.
// Built against the C/C++ API with ORT_API_MANUAL_INIT; no onnxruntime library is linked.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "continuous_slice_ffn.h"
#ifdef INFMOE_WITH_CUDA
#include "continuous_slice_ffn_cuda.h"
#endif

namespace {

constexpr const char* kDomain = "infmoe";
constexpr const char* kOpName = "ContinuousSliceFFN";

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

[[noreturn]] void Fail(const std::string& message) {
  throw Ort::Exception(std::string(kOpName) + ": " + message, ORT_INVALID_ARGUMENT);
}

// Checks every input shape against X's and returns the flattened sizes.
infmoe::Sizes CheckShapes(const std::vector<std::vector<int64_t>>& shapes, int64_t r) {
  const auto& x = shapes[0];
  const auto& starts = shapes[1];
  if (x.empty()) Fail("X must have at least one dimension [..., D], got a scalar");
  const int64_t d = x.back();
  if (starts.size() != x.size()) Fail("starts " + ShapeString(starts) + " must have the same rank as X " + ShapeString(x));
  for (size_t i = 0; i + 1 < x.size(); ++i) {
    if (starts[i] != x[i]) Fail("starts " + ShapeString(starts) + " must have the leading dims of X " + ShapeString(x));
  }
  const int64_t k = starts.back();
  if (k < 1) Fail("starts " + ShapeString(starts) + " must hold at least one window per token");
  const auto& w_in = shapes[2];
  if (w_in.size() != 2 || w_in[1] != d) Fail("w_in " + ShapeString(w_in) + " must be [H, D] with D = " + std::to_string(d));
  const int64_t h = w_in[0];
  if (shapes[3] != std::vector<int64_t>{h}) Fail("b_in " + ShapeString(shapes[3]) + " must be [H] = [" + std::to_string(h) + "]");
  if (shapes[4] != w_in) Fail("w_out " + ShapeString(shapes[4]) + " must be [H, D] = " + ShapeString(w_in));
  if (shapes[5] != std::vector<int64_t>{d}) Fail("b_out " + ShapeString(shapes[5]) + " must be [D] = [" + std::to_string(d) + "]");
  if (r > h) Fail("slice_width " + std::to_string(r) + " is larger than H = " + std::to_string(h));
  int64_t tokens = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) tokens *= x[i];
  return {tokens, d, h, k, r};
}

void RequireValidStarts(const int64_t* starts, const infmoe::Sizes& s) {
  const std::string problem = infmoe::CheckStarts(starts, s);
  if (!problem.empty()) Fail(problem);
}

// Attributes shared by the CPU and CUDA kernels.
struct Attributes {
  int64_t slice_width = 0;

  explicit Attributes(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info(info);
    slice_width = kernel_info.GetAttribute<int64_t>("slice_width");
    if (slice_width < 1) Fail("slice_width must be >= 1, got " + std::to_string(slice_width));
    // Optional, default gelu_tanh (the config default); plugin_namespace/plugin_version are for
    // TensorRT and ignored here.
    std::string activation = "gelu_tanh";
    bool is_string = true;
    try {
      activation = kernel_info.GetAttribute<std::string>("activation");
    } catch (const Ort::Exception&) {
      is_string = false;
    }
    // Absent means the default; present with another type is refused, never read as the default.
    bool other_type = false;
    if (!is_string) {
      try {
        (void)kernel_info.GetAttribute<int64_t>("activation");
        other_type = true;
      } catch (const Ort::Exception&) {
      }
      try {
        (void)kernel_info.GetAttribute<float>("activation");
        other_type = true;
      } catch (const Ort::Exception&) {
      }
    }
    if (other_type) Fail("attribute 'activation' must be a string such as \"gelu_tanh\"");
    if (activation != "gelu_tanh") Fail("unknown activation '" + activation + "' (known: gelu_tanh)");
  }
};

// Converts any exception into an OrtStatus: onnxruntime reports it, nothing unwinds through C.
template <typename Body>
OrtStatusPtr Guard(Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const Ort::Exception& error) {
    return Ort::GetApi().CreateStatus(error.GetOrtErrorCode(), error.what());
  } catch (const std::exception& error) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, (std::string(kOpName) + ": " + error.what()).c_str());
  }
}

// The op's six inputs and their shapes.
struct Inputs {
  std::vector<Ort::ConstValue> values;
  std::vector<std::vector<int64_t>> shapes;

  explicit Inputs(const Ort::KernelContext& context) {
    for (size_t i = 0; i < 6; ++i) {
      values.push_back(context.GetInput(i));
      shapes.push_back(values.back().GetTensorTypeAndShapeInfo().GetShape());
    }
  }
};

template <typename T>
struct CpuKernel {
  Attributes attributes;
  explicit CpuKernel(const OrtKernelInfo* info) : attributes(info) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard([&] {
      Ort::KernelContext context(raw_context);
      const Inputs inputs(context);
      const infmoe::Sizes sizes = CheckShapes(inputs.shapes, attributes.slice_width);
      const int64_t* starts = inputs.values[1].GetTensorData<int64_t>();
      RequireValidStarts(starts, sizes);
      Ort::UnownedValue output = context.GetOutput(0, inputs.shapes[0]);

      const infmoe::ParallelFor parallel_for = [&](size_t n, const std::function<void(size_t)>& body) {
        if (n == 1) return body(0);
        auto call = [](void* data, size_t i) { (*static_cast<const std::function<void(size_t)>*>(data))(i); };
        context.ParallelFor(call, n, 0, const_cast<std::function<void(size_t)>*>(&body));
      };
      auto data = [&](size_t i) { return reinterpret_cast<const T*>(inputs.values[i].GetTensorRawData()); };
      infmoe::ContinuousSliceFFN<T>(sizes, data(0), starts, data(2), data(3), data(4), data(5),
                                    reinterpret_cast<T*>(output.GetTensorMutableRawData()), parallel_for);
    });
  }
};

#ifdef INFMOE_WITH_CUDA
// Same checks; starts are copied to the host to be range-checked before any kernel runs.
template <typename T>
struct CudaKernel {
  Attributes attributes;
  explicit CudaKernel(const OrtKernelInfo* info) : attributes(info) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard([&] {
      Ort::KernelContext context(raw_context);
      const Inputs inputs(context);
      const infmoe::Sizes sizes = CheckShapes(inputs.shapes, attributes.slice_width);
      void* stream = context.GetGPUComputeStream();
      const int64_t* starts = inputs.values[1].GetTensorData<int64_t>();
      std::vector<int64_t> host_starts(sizes.tokens * sizes.k);
      infmoe::cuda::CopyToHost(starts, static_cast<int64_t>(host_starts.size()), host_starts.data(), stream);
      RequireValidStarts(host_starts.data(), sizes);
      Ort::UnownedValue output = context.GetOutput(0, inputs.shapes[0]);
      auto data = [&](size_t i) { return reinterpret_cast<const T*>(inputs.values[i].GetTensorRawData()); };
      infmoe::cuda::ContinuousSliceFFN<T>(sizes, data(0), starts, data(2), data(3), data(4), data(5),
                                          reinterpret_cast<T*>(output.GetTensorMutableRawData()), stream);
    });
  }
};
#endif

template <typename Kernel, ONNXTensorElementDataType Type>
struct Op : Ort::CustomOpBase<Op<Kernel, Type>, Kernel, true> {
  explicit Op(const char* provider) : provider_(provider) {}

  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return Guard([&] { *kernel = new Kernel(info); });
  }
  const char* GetName() const { return kOpName; }
  const char* GetExecutionProviderType() const { return provider_; }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : Type;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return Type; }

 private:
  const char* provider_;
};

// float16 travels as its 16 raw bits; the kernel converts to float.
Op<CpuKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_float(nullptr);
Op<CpuKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cpu_half(nullptr);
#ifdef INFMOE_WITH_CUDA
Op<CudaKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cuda_float("CUDAExecutionProvider");
Op<CudaKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cuda_half("CUDAExecutionProvider");
#endif

std::mutex domains_mutex;
std::vector<Ort::CustomOpDomain> domains;  // must outlive every session that uses them

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  // Ask for the API version of the headers we were compiled with: any newer runtime serves it.
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const std::string message = std::string("libinfmoe_ort needs onnxruntime API version ") +
                                std::to_string(ORT_API_VERSION) + ", this runtime is " + api_base->GetVersionString();
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, message.c_str());
  }
  Ort::InitApi(api);
  return Guard([&] {
    Ort::CustomOpDomain domain(kDomain);
    domain.Add(&cpu_float);
    domain.Add(&cpu_half);
#ifdef INFMOE_WITH_CUDA
    domain.Add(&cuda_float);
    domain.Add(&cuda_half);
#endif
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  });
}
