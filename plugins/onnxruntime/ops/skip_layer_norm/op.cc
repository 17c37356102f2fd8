// onnxruntime glue for infmoe::SkipLayerNorm v1: type and shape checks, output allocation.
#include <cmath>

#include "common/ort_glue.h"
#include "ops/skip_layer_norm/skip_layer_norm.h"

namespace infmoe {
namespace ort {
namespace {

// SkipLayerNorm: input and skip [..., D] (the same shape), gamma, beta [D], bias [D] (optional);
// attribute epsilon; outputs output [..., D] and input_skip_bias_sum [..., D] (optional).
// float32 only (the onnxruntime target's activations); the other inputs' types are checked here, by name.
constexpr const char* kNormNames[] = {"input", "skip", "gamma", "beta", "bias"};

infmoe::NormSizes CheckNorm(const Inputs& in) {
  for (size_t i : {1, 2, 3, 4}) {
    if (in.Present(i) && in.types[i] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      Fail(std::string(kNormNames[i]) + " must be float32, got " + TypeName(in.types[i]));
    }
  }
  const auto& x = in.shapes[0];
  if (x.empty()) Fail("input must have at least one dimension [..., D], got a scalar");
  if (in.shapes[1] != x) Fail("skip " + ShapeString(in.shapes[1]) + " must have input's shape " + ShapeString(x));
  infmoe::NormSizes s{1, x.back()};
  for (size_t i = 0; i + 1 < x.size(); ++i) s.rows *= x[i];
  if (s.d < 1) Fail("input " + ShapeString(x) + " must have D >= 1 values a row");
  for (size_t i : {2, 3, 4}) {
    if (i < 4 || in.Present(i)) RequireShape(kNormNames[i], in.shapes[i], {s.d}, "[D]");
  }
  return s;
}

struct SkipLayerNormCpuKernel {
  static constexpr const char* kName = "SkipLayerNorm";
  static constexpr size_t kInputs = 5, kOutputs = 2;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  static bool Optional(size_t index) { return index == 4; }
  static bool OptionalOutput(size_t index) { return index == 1; }
  static ONNXTensorElementDataType OutputType(size_t, ONNXTensorElementDataType x) { return x; }

  float epsilon;
  ConstantInputs constants;
  explicit SkipLayerNormCpuKernel(const OrtKernelInfo* info)
      : epsilon(RequiredAttribute<float>(Ort::ConstKernelInfo(info), "epsilon", "the variance's addend")),
        constants(info, kInputs) {
    if (!(epsilon >= 0.0f) || std::isinf(epsilon)) Fail("epsilon must be finite and >= 0, got " + std::to_string(epsilon));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const infmoe::NormSizes s = CheckNorm(inputs);
      const std::vector<int64_t>& shape = inputs.shapes[0];
      Ort::UnownedValue y = context.GetOutput(0, shape);
      float* sum = nullptr;
      if (context.GetOutputCount() > 1) {
        Ort::UnownedValue total = context.GetOutput(1, shape);
        if (total) sum = total.GetTensorMutableData<float>();
      }
      infmoe::SkipLayerNorm(s, inputs.Data<float>(0), inputs.Data<float>(1), inputs.Data<float>(2),
                            inputs.Data<float>(3), inputs.Data<float>(4), epsilon, y.GetTensorMutableData<float>(), sum,
                            ParallelForOf(context));
    });
  }
};

}  // namespace

std::vector<OrtCustomOp*> SkipLayerNormOps() {
  static Op<SkipLayerNormCpuKernel, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu(nullptr);
  return {&cpu};
}

}  // namespace ort
}  // namespace infmoe
