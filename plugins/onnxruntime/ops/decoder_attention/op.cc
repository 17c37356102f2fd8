// onnxruntime glue for infmoe::DecoderAttention v1: type and shape checks, output allocation.
#include "common/ort_glue.h"
#include "ops/decoder_attention/decoder_attention.h"

namespace infmoe {
namespace ort {
namespace {

// DecoderAttention: qkv [B, S, 3 H d], past_key and past_value [B, H, P, d] (optional: both or
// neither), seqlens_k int32 [B], total_sequence_length int32 [1], attention_bias [1 or B, 1, S, T],
// qkv_bias [3 H d] (optional); outputs y [B, S, H d], present_key and present_value [B, H, max(P, T), d].
// Activations float32 (the onnxruntime target's); the cache (past and present) float32 or float16, one
// kernel each, chosen by its type; the other inputs' types are checked here, by name.
constexpr const char* kAttentionNames[] = {"qkv", "past_key", "past_value", "seqlens_k", "total_sequence_length",
                                           "attention_bias", "qkv_bias"};

infmoe::AttentionSizes CheckAttention(const Inputs& in, int64_t heads, ONNXTensorElementDataType cache,
                                      const int32_t*& seqlens_k) {
  const auto require_type = [&](size_t i, ONNXTensorElementDataType type) {
    if (in.types[i] != type) Fail(std::string(kAttentionNames[i]) + " must be " + TypeName(type) + ", got " + TypeName(in.types[i]));
  };
  for (size_t i : {1, 2}) {
    if (in.Present(i)) require_type(i, cache);
  }
  for (size_t i : {5, 6}) {
    if (in.Present(i)) require_type(i, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  }
  require_type(3, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
  require_type(4, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
  if (!in.Present(5)) Fail("attention_bias is required (the causal mask is the op's, padding comes as bias)");
  const auto& qkv = in.shapes[0];
  if (qkv.size() != 3 || qkv[2] % (3 * heads) != 0 || qkv[2] == 0) {
    Fail("qkv " + ShapeString(qkv) + " must be [batch, sequence, 3 num_heads head_dim] with num_heads = " +
         std::to_string(heads));
  }
  infmoe::AttentionSizes s{qkv[0], qkv[1], heads, qkv[2] / (3 * heads), 0, 0, 0, false};
  if (in.Present(1) != in.Present(2)) Fail("past_key and past_value must be given both or neither");
  if (in.Present(1)) {
    const auto& past = in.shapes[1];
    if (past.size() != 4) Fail("past_key " + ShapeString(past) + " must be [batch, num_heads, past, head_dim]");
    s.past = past[2];
    RequireShape("past_key", past, {s.batch, heads, s.past, s.head_dim}, "[batch, num_heads, past, head_dim]");
    RequireShape("past_value", in.shapes[2], {s.batch, heads, s.past, s.head_dim}, "past_key's shape");
  }
  RequireShape("seqlens_k", in.shapes[3], {s.batch}, "[batch]");
  if (in.Present(6)) RequireShape("qkv_bias", in.shapes[6], {qkv[2]}, "[3 num_heads head_dim]");
  const auto& total = in.shapes[4];
  if (!(total.empty() || (total.size() == 1 && total[0] == 1))) {
    Fail("total_sequence_length " + ShapeString(total) + " must hold one value");
  }
  s.total = *in.Data<int32_t>(4);
  // At most past + sequence: present (max(past, total) positions) is then no larger than the
  // inputs it is made of, whatever the value says.
  if (s.total < 1 || s.total > s.past + s.sequence) {
    Fail("total_sequence_length must be in [1, past + sequence] = [1, " + std::to_string(s.past + s.sequence) +
         "], got " + std::to_string(s.total));
  }
  s.present = std::max(s.past, s.total);
  const auto& bias = in.shapes[5];
  if (bias.size() != 4 || (bias[0] != 1 && bias[0] != s.batch) || bias[1] != 1 || bias[2] != s.sequence ||
      bias[3] != s.total) {
    Fail("attention_bias " + ShapeString(bias) + " must be [1 or batch, 1, sequence, total_sequence_length] = [1 or " +
         std::to_string(s.batch) + ", 1, " + std::to_string(s.sequence) + ", " + std::to_string(s.total) + "]");
  }
  s.bias_batch = bias[0] == s.batch && s.batch != 1;
  seqlens_k = in.Data<int32_t>(3);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t length = int64_t{seqlens_k[b]} + 1, past = length - s.sequence;
    if (past < 0 || past > s.past || length > s.total) {
      Fail("seqlens_k[" + std::to_string(b) + "] = " + std::to_string(seqlens_k[b]) + " must be in [" +
           std::to_string(s.sequence - 1) + ", " + std::to_string(std::min(s.past + s.sequence, s.total) - 1) +
           "] (sequence - 1 to min(past + sequence, total_sequence_length) - 1)");
    }
  }
  return s;
}

// C: the cache's element, float or uint16_t (float16).
template <typename C>
struct AttentionCpuKernel {
  static constexpr const char* kName = "DecoderAttention";
  static constexpr size_t kInputs = 7, kOutputs = 3;
  static constexpr ONNXTensorElementDataType kCache =
      std::is_same_v<C, float> ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : index <= 2 ? kCache : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  static bool Optional(size_t index) { return index == 1 || index == 2 || index == 6; }
  static bool OptionalOutput(size_t) { return false; }
  static ONNXTensorElementDataType OutputType(size_t index, ONNXTensorElementDataType x) { return index == 0 ? x : kCache; }

  int64_t heads;
  ConstantInputs constants;
  explicit AttentionCpuKernel(const OrtKernelInfo* info)
      : heads(RequiredAttribute<int64_t>(Ort::ConstKernelInfo(info), "num_heads", "the number of query, key and value heads")),
        constants(info, kInputs) {
    if (heads < 1) Fail("num_heads must be >= 1, got " + std::to_string(heads));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const int32_t* seqlens_k = nullptr;
      const infmoe::AttentionSizes s = CheckAttention(inputs, heads, kCache, seqlens_k);
      const int64_t output[] = {s.batch, s.sequence, s.heads * s.head_dim}, cache[] = {s.batch, s.heads, s.present, s.head_dim};
      Ort::UnownedValue y = context.GetOutput(0, output, 3);
      Ort::UnownedValue key = context.GetOutput(1, cache, 4), value = context.GetOutput(2, cache, 4);
      infmoe::DecoderAttention<C>(s, inputs.Data<float>(0), inputs.Data<C>(1), inputs.Data<C>(2), seqlens_k,
                                  inputs.Data<float>(5), inputs.Data<float>(6), y.GetTensorMutableData<float>(),
                                  static_cast<C*>(key.GetTensorMutableRawData()),
                                  static_cast<C*>(value.GetTensorMutableRawData()), ParallelForOf(context));
    });
  }
};


}  // namespace

std::vector<OrtCustomOp*> DecoderAttentionOps() {
  static Op<AttentionCpuKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu(nullptr);
  static Op<AttentionCpuKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_half_cache(nullptr);
  return {&cpu, &cpu_half_cache};
}

}  // namespace ort
}  // namespace infmoe
