// onnxruntime glue for infmoe::WindowStarts v1: type and shape checks, output allocation.
#include "common/ort_glue.h"
#include "ops/window_starts/window_starts.h"

namespace infmoe {
namespace ort {
namespace {

// WindowStarts: X [..., D] float32, weight [D, 2] (mu's column, then sigma's), bias [2], eps [K] or
// [..., K] (X's leading dims); attributes ffn_hidden (H) and slice_width (r). Output starts int64
// [..., K]. Types other than X's are checked here, by name.
constexpr const char* kRouterNames[] = {"X", "weight", "bias", "eps"};

infmoe::RouterSizes CheckRouter(const Inputs& in, int64_t h, int64_t r) {
  for (size_t i : {1, 2, 3}) {
    if (in.types[i] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      Fail(std::string(kRouterNames[i]) + " must be float32, got " + TypeName(in.types[i]));
    }
  }
  const auto& x = in.shapes[0];
  if (x.empty()) Fail("X must have at least one dimension [..., D], got a scalar");
  infmoe::RouterSizes s{1, x.back(), 0, h, r, false};
  for (size_t i = 0; i + 1 < x.size(); ++i) s.tokens *= x[i];
  RequireShape("weight", in.shapes[1], {s.d, 2}, "[D, 2]");
  RequireShape("bias", in.shapes[2], {2}, "[2]");
  const auto& eps = in.shapes[3];
  if (eps.size() == 1) {
    s.k = eps[0];
  } else {
    std::vector<int64_t> expected(x.begin(), x.end() - 1);
    expected.push_back(eps.empty() ? 0 : eps.back());
    if (eps.empty() || eps != expected) {
      Fail("eps " + ShapeString(eps) + " must be [K] or X's leading dims and K = [..., K] with X " + ShapeString(x));
    }
    s.k = eps.back(), s.eps_per_token = true;
  }
  if (s.k < 1) Fail("eps " + ShapeString(eps) + " must hold at least one sample (K >= 1)");
  return s;
}

struct WindowStartsCpuKernel : OneOutput {
  static constexpr const char* kName = "WindowStarts";
  static constexpr size_t kInputs = 4;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  static ONNXTensorElementDataType OutputType(size_t, ONNXTensorElementDataType) {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }

  int64_t h, r;
  ConstantInputs constants;
  explicit WindowStartsCpuKernel(const OrtKernelInfo* info)
      : h(RequiredAttribute<int64_t>(Ort::ConstKernelInfo(info), "ffn_hidden", "H, the expert's hidden units")),
        r(RequiredAttribute<int64_t>(Ort::ConstKernelInfo(info), "slice_width", "r, the window's width")),
        constants(info, kInputs) {
    if (r < 1 || r > h) Fail("slice_width must be in [1, ffn_hidden], got " + std::to_string(r) + " with ffn_hidden = " + std::to_string(h));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const infmoe::RouterSizes s = CheckRouter(inputs, h, r);
      Ort::UnownedValue starts = context.GetOutput(0, WithLast(inputs.shapes[0], s.k));
      infmoe::WindowStarts(s, inputs.Data<float>(0), inputs.Data<float>(1), inputs.Data<float>(2), inputs.Data<float>(3),
                           starts.GetTensorMutableData<int64_t>(), ParallelForOf(context));
    });
  }
};


}  // namespace

std::vector<OrtCustomOp*> WindowStartsOps() {
  static Op<WindowStartsCpuKernel, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu(nullptr);
  return {&cpu};
}

}  // namespace ort
}  // namespace infmoe
