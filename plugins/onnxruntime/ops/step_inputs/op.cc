// onnxruntime glue for infmoe::StepInputs v1: type and shape checks, output allocation.
#include "common/ort_glue.h"
#include "ops/step_inputs/step_inputs.h"

namespace infmoe {
namespace ort {
namespace {

// StepInputs: input_ids [B, S] (for S), attention_mask [B, T] int64; outputs position_ids int64
// [B, S], seqlens_k int32 [B], total_sequence_length int32 [1] (= T), attention_bias float32
// [B, 1, S, T].
constexpr int64_t kMaxBiasElements = int64_t{1} << 30;  // 4 GiB of attention_bias: refused beyond

infmoe::StepSizes CheckStepInputs(const Inputs& in) {
  const auto &ids = in.shapes[0], &mask = in.shapes[1];
  if (ids.size() != 2) Fail("input_ids " + ShapeString(ids) + " must be [batch, sequence]");
  if (mask.size() != 2 || mask[0] != ids[0] || mask[1] < std::max<int64_t>(ids[1], 1)) {
    Fail("attention_mask " + ShapeString(mask) + " must be [batch, total] with input_ids " + ShapeString(ids) +
         " (total >= max(sequence, 1))");
  }
  const infmoe::StepSizes s{ids[0], ids[1], mask[1]};
  if (s.total > std::numeric_limits<int32_t>::max()) Fail("attention_mask's length must fit int32 (seqlens_k)");
  if (s.sequence && s.batch * s.total > kMaxBiasElements / s.sequence) {
    Fail("attention_bias [" + std::to_string(s.batch) + ", 1, " + std::to_string(s.sequence) + ", " +
         std::to_string(s.total) + "] would hold more than 2^30 values");
  }
  return s;
}

struct StepInputsCpuKernel {
  static constexpr const char* kName = "StepInputs";
  static constexpr size_t kInputs = 2, kOutputs = 4;
  static ONNXTensorElementDataType InputType(size_t, ONNXTensorElementDataType) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
  static bool Optional(size_t) { return false; }
  static bool OptionalOutput(size_t) { return false; }
  static ONNXTensorElementDataType OutputType(size_t index, ONNXTensorElementDataType) {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
           : index == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  }

  ConstantInputs constants;
  explicit StepInputsCpuKernel(const OrtKernelInfo* info) : constants(info, kInputs) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const infmoe::StepSizes s = CheckStepInputs(inputs);
      const int64_t positions[] = {s.batch, s.sequence}, bias[] = {s.batch, 1, s.sequence, s.total}, one = 1;
      Ort::UnownedValue position_ids = context.GetOutput(0, positions, 2);
      Ort::UnownedValue seqlens_k = context.GetOutput(1, &s.batch, 1);
      Ort::UnownedValue total = context.GetOutput(2, &one, 1);
      Ort::UnownedValue attention_bias = context.GetOutput(3, bias, 4);
      *total.GetTensorMutableData<int32_t>() = static_cast<int32_t>(s.total);
      infmoe::StepInputs(s, inputs.Data<int64_t>(1), position_ids.GetTensorMutableData<int64_t>(),
                         seqlens_k.GetTensorMutableData<int32_t>(), attention_bias.GetTensorMutableData<float>());
    });
  }
};


}  // namespace

std::vector<OrtCustomOp*> StepInputsOps() {
  static Op<StepInputsCpuKernel, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64> cpu(nullptr);
  return {&cpu};
}

}  // namespace ort
}  // namespace infmoe
