// onnxruntime glue for infmoe::ContinuousSliceFFN v1 (SPEC §4) and infmoe::QContinuousSliceFFN v1
// (SPEC §6): attribute, type and shape checks, output allocation, the CPU and CUDA kernels.
#include "common/ort_glue.h"
#include "ops/continuous_slice_ffn/continuous_slice_ffn.h"
#ifdef INFMOE_WITH_CUDA
#include "ops/continuous_slice_ffn/cuda.h"
#endif

namespace infmoe {
namespace ort {
namespace {

// X [..., D] and starts [..., K]: the flattened sizes, with h and r still to be filled in.
infmoe::Sizes CheckTokens(const std::vector<int64_t>& x, const std::vector<int64_t>& starts) {
  if (x.empty()) Fail("X must have at least one dimension [..., D], got a scalar");
  if (starts.size() != x.size()) Fail("starts " + ShapeString(starts) + " must have the same rank as X " + ShapeString(x));
  for (size_t i = 0; i + 1 < x.size(); ++i) {
    if (starts[i] != x[i]) Fail("starts " + ShapeString(starts) + " must have the leading dims of X " + ShapeString(x));
  }
  const int64_t k = starts.back();
  if (k < 1) Fail("starts " + ShapeString(starts) + " must hold at least one window per token");
  int64_t tokens = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) tokens *= x[i];
  return {tokens, x.back(), 0, k, 0};
}

// The checks that follow H: b_in, b_out and slice_width.
void CheckBiases(const std::vector<int64_t>& b_in, const std::vector<int64_t>& b_out, infmoe::Sizes& s, int64_t r) {
  RequireShape("b_in", b_in, {s.h}, "[H]");
  RequireShape("b_out", b_out, {s.d}, "[D]");
  if (r > s.h) Fail("slice_width " + std::to_string(r) + " is larger than H = " + std::to_string(s.h));
  s.r = r;
}

// ContinuousSliceFFN: X, starts, w_in [H, D], b_in, w_out [H, D], b_out.
infmoe::Sizes CheckShapes(const std::vector<std::vector<int64_t>>& shapes, int64_t r) {
  infmoe::Sizes s = CheckTokens(shapes[0], shapes[1]);
  const auto& w_in = shapes[2];
  if (w_in.size() != 2 || w_in[1] != s.d) Fail("w_in " + ShapeString(w_in) + " must be [H, D] with D = " + std::to_string(s.d));
  s.h = w_in[0];
  RequireShape("w_out", shapes[4], {s.h, s.d}, "[H, D]");
  CheckBiases(shapes[3], shapes[5], s, r);
  return s;
}

void RequireValidStarts(const int64_t* starts, const infmoe::Sizes& s) {
  const std::string problem = infmoe::CheckStarts(starts, s);
  if (!problem.empty()) Fail(problem);
}

// Attributes shared by the ops and the CPU and CUDA kernels.
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

struct QuantizedAttributes : Attributes {
  infmoe::Quantization quantization;
  explicit QuantizedAttributes(const OrtKernelInfo* info)
      : Attributes(info), quantization(QuantizationOf(Ort::ConstKernelInfo(info))) {}
};

template <typename T>
struct CpuKernel : OneOutput {
  static constexpr const char* kName = "ContinuousSliceFFN";
  static constexpr size_t kInputs = 6;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : x;
  }

  Attributes attributes;
  ConstantInputs constants;
  explicit CpuKernel(const OrtKernelInfo* info) : attributes(info), constants(info, kInputs) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const infmoe::Sizes sizes = CheckShapes(inputs.shapes, attributes.slice_width);
      const int64_t* starts = inputs.Data<int64_t>(1);
      RequireValidStarts(starts, sizes);
      Ort::UnownedValue output = context.GetOutput(0, inputs.shapes[0]);
      infmoe::ContinuousSliceFFN<T>(sizes, inputs.Data<T>(0), starts, inputs.Data<T>(2), inputs.Data<T>(3),
                                    inputs.Data<T>(4), inputs.Data<T>(5), reinterpret_cast<T*>(output.GetTensorMutableRawData()),
                                    ParallelForOf(context));
    });
  }
};

// QContinuousSliceFFN: X, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out. Only X's
// and starts' types are declared to onnxruntime; the others accept any type and are checked here,
// so that a wrong one is refused by name (not as "no kernel found").
constexpr const char* kQuantizedNames[] = {"X", "starts", "w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out"};

infmoe::Sizes CheckQuantized(const Inputs& in, const QuantizedAttributes& attributes) {
  for (size_t i : {2, 5}) {
    if (in.types[i] != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
      Fail(std::string(kQuantizedNames[i]) + " must be uint8, got " + TypeName(in.types[i]));
    }
  }
  for (size_t i : {3, 4, 6, 7}) {
    if (in.types[i] != in.types[0]) {
      Fail(std::string(kQuantizedNames[i]) + " must have X's element type " + TypeName(in.types[0]) + ", got " +
           TypeName(in.types[i]));
    }
  }
  infmoe::Sizes s = CheckTokens(in.shapes[0], in.shapes[1]);
  const auto& q = attributes.quantization;
  const int64_t columns = q.bits == 8 ? s.d : (s.d + 1) / 2;
  const int64_t blocks = s.d / q.block_size + (s.d % q.block_size != 0);
  const auto& w_in = in.shapes[2];
  const auto rows = [&] {
    return "[H, " + std::to_string(columns) + "] for D = " + std::to_string(s.d) + ", bits = " + std::to_string(q.bits);
  };
  if (w_in.size() != 2 || w_in[1] != columns) Fail("w_in_q " + ShapeString(w_in) + " must be " + rows());
  s.h = w_in[0];
  const auto scales = [&] {
    return "[H, ceil(D / block_size)] for D = " + std::to_string(s.d) + ", block_size = " + std::to_string(q.block_size);
  };
  RequireShape("w_out_q", in.shapes[5], {s.h, columns}, rows);
  RequireShape("w_in_scale", in.shapes[3], {s.h, blocks}, scales);
  RequireShape("w_out_scale", in.shapes[6], {s.h, blocks}, scales);
  CheckBiases(in.shapes[4], in.shapes[7], s, attributes.slice_width);
  return s;
}

// kInt8: the session's activations are int8 (register.cc).
template <typename T, bool kInt8>
struct QuantizedCpuKernel : OneOutput {
  static constexpr const char* kName = "QContinuousSliceFFN";
  static constexpr size_t kInputs = 8;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }

  QuantizedAttributes attributes;
  ConstantInputs constants;
  explicit QuantizedCpuKernel(const OrtKernelInfo* info) : attributes(info), constants(info, kInputs) {
    attributes.quantization.int8_activations = kInt8;
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const infmoe::Sizes sizes = CheckQuantized(inputs, attributes);
      const int64_t* starts = inputs.Data<int64_t>(1);
      RequireValidStarts(starts, sizes);
      Ort::UnownedValue output = context.GetOutput(0, inputs.shapes[0]);
      infmoe::QContinuousSliceFFN<T>(sizes, attributes.quantization, inputs.Data<T>(0), starts,
                                     {inputs.Data<uint8_t>(2), inputs.Data<T>(3)}, inputs.Data<T>(4),
                                     {inputs.Data<uint8_t>(5), inputs.Data<T>(6)}, inputs.Data<T>(7),
                                     reinterpret_cast<T*>(output.GetTensorMutableRawData()), ParallelForOf(context));
    });
  }
};

#ifdef INFMOE_WITH_CUDA
// Same checks; starts are copied to the host to be range-checked before any kernel runs.
template <typename T>
struct CudaKernel : CpuKernel<T> {
  using CpuKernel<T>::CpuKernel;

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(this->kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, this->constants);
      const infmoe::Sizes sizes = CheckShapes(inputs.shapes, this->attributes.slice_width);
      void* stream = context.GetGPUComputeStream();
      const int64_t* starts = inputs.Data<int64_t>(1);
      std::vector<int64_t> host_starts(sizes.tokens * sizes.k);
      infmoe::cuda::CopyToHost(starts, static_cast<int64_t>(host_starts.size()), host_starts.data(), stream);
      RequireValidStarts(host_starts.data(), sizes);
      Ort::UnownedValue output = context.GetOutput(0, inputs.shapes[0]);
      infmoe::cuda::ContinuousSliceFFN<T>(sizes, inputs.Data<T>(0), starts, inputs.Data<T>(2), inputs.Data<T>(3),
                                          inputs.Data<T>(4), inputs.Data<T>(5), reinterpret_cast<T*>(output.GetTensorMutableRawData()),
                                          stream);
    });
  }
};
#endif

}  // namespace

// float16 travels as its 16 raw bits; the kernel converts to float.
std::vector<OrtCustomOp*> ContinuousSliceFFNOps() {
  static Op<CpuKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_float(nullptr);
  static Op<CpuKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cpu_half(nullptr);
  return {&cpu_float, &cpu_half};
}

std::vector<OrtCustomOp*> QContinuousSliceFFNOps(bool int8_activations) {
  static Op<QuantizedCpuKernel<float, false>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_float(nullptr);
  static Op<QuantizedCpuKernel<uint16_t, false>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cpu_half(nullptr);
  static Op<QuantizedCpuKernel<float, true>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> int8_float(nullptr);
  static Op<QuantizedCpuKernel<uint16_t, true>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> int8_half(nullptr);
  if (int8_activations) return {&int8_float, &int8_half};
  return {&cpu_float, &cpu_half};
}

std::vector<OrtCustomOp*> ContinuousSliceFFNCudaOps() {
#ifdef INFMOE_WITH_CUDA
  static Op<CudaKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cuda_float("CUDAExecutionProvider");
  static Op<CudaKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cuda_half("CUDAExecutionProvider");
  return {&cuda_float, &cuda_half};
#else
  return {};
#endif
}

}  // namespace ort
}  // namespace infmoe
