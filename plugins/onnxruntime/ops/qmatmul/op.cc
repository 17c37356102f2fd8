// onnxruntime glue for infmoe::QMatMul v1: attribute, type and shape checks, output allocation.
#include "common/ort_glue.h"
#include "ops/qmatmul/qmatmul.h"

namespace infmoe {
namespace ort {
namespace {

// QMatMul's: K and N (MatMulNBits' names), bits and block_size.
struct MatMulAttributes {
  infmoe::Quantization quantization;
  int64_t k, n;
  explicit MatMulAttributes(const OrtKernelInfo* info) : quantization(QuantizationOf(Ort::ConstKernelInfo(info))) {
    Ort::ConstKernelInfo kernel_info(info);
    k = RequiredAttribute<int64_t>(kernel_info, "K", "A's last dimension");
    n = RequiredAttribute<int64_t>(kernel_info, "N", "the output's last dimension");
    if (k < 1 || n < 1) Fail("K and N must be >= 1, got K = " + std::to_string(k) + ", N = " + std::to_string(n));
  }
};

// QMatMul: A [..., K], B uint8 [N, ceil(K / block_size), block_size * bits / 8] (SPEC §6's storage,
// each row padded to whole blocks: MatMulNBits' layout), scales [N, ceil(K / block_size)] of A's
// type. Types other than A's are checked here, as for QContinuousSliceFFN.
infmoe::MatMulSizes CheckMatMul(const Inputs& in, const MatMulAttributes& attributes) {
  if (in.types[1] != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) Fail(std::string("B must be uint8, got ") + TypeName(in.types[1]));
  if (in.types[2] != in.types[0]) {
    Fail(std::string("scales must have A's element type ") + TypeName(in.types[0]) + ", got " + TypeName(in.types[2]));
  }
  const auto& a = in.shapes[0];
  const int64_t k = attributes.k, n = attributes.n;
  if (a.empty() || a.back() != k) Fail("A " + ShapeString(a) + " must be [..., K] with K = " + std::to_string(k));
  const auto& q = attributes.quantization;
  const int64_t blocks = k / q.block_size + (k % q.block_size != 0);
  const auto for_attributes = [&] {
    return " for K = " + std::to_string(k) + ", N = " + std::to_string(n) + ", bits = " + std::to_string(q.bits) +
           ", block_size = " + std::to_string(q.block_size);
  };
  RequireShape("B", in.shapes[1], {n, blocks, q.block_size * q.bits / 8},
               [&] { return "[N, ceil(K / block_size), block_size * bits / 8]" + for_attributes(); });
  RequireShape("scales", in.shapes[2], {n, blocks}, [&] { return "[N, ceil(K / block_size)]" + for_attributes(); });
  int64_t tokens = 1;
  for (size_t i = 0; i + 1 < a.size(); ++i) tokens *= a[i];
  return {tokens, k, n};
}

// kInt8: the session's activations are int8 (register.cc).
template <typename T, bool kInt8>
struct QMatMulCpuKernel : OneOutput {
  static constexpr const char* kName = "QMatMul";
  static constexpr size_t kInputs = 3;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }

  MatMulAttributes attributes;
  ConstantInputs constants;
  explicit QMatMulCpuKernel(const OrtKernelInfo* info) : attributes(info), constants(info, kInputs) {
    attributes.quantization.int8_activations = kInt8;
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const infmoe::MatMulSizes sizes = CheckMatMul(inputs, attributes);
      Ort::UnownedValue output = context.GetOutput(0, WithLast(inputs.shapes[0], sizes.n));
      infmoe::QMatMul<T>(sizes, attributes.quantization, inputs.Data<T>(0), {inputs.Data<uint8_t>(1), inputs.Data<T>(2)},
                         reinterpret_cast<T*>(output.GetTensorMutableRawData()), ParallelForOf(context));
    });
  }
};


}  // namespace

std::vector<OrtCustomOp*> QMatMulOps(bool int8_activations) {
  static Op<QMatMulCpuKernel<float, false>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_float(nullptr);
  static Op<QMatMulCpuKernel<uint16_t, false>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cpu_half(nullptr);
  static Op<QMatMulCpuKernel<float, true>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> int8_float(nullptr);
  static Op<QMatMulCpuKernel<uint16_t, true>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> int8_half(nullptr);
  if (int8_activations) return {&int8_float, &int8_half};
  return {&cpu_float, &cpu_half};
}
}  // namespace ort
}  // namespace infmoe
