// onnxruntime glue for infmoe::ContinuousSliceFFN v1 (SPEC §4), infmoe::QContinuousSliceFFN v1
// (SPEC §6), infmoe::QMatMul v1, infmoe::DecoderAttention v1 and infmoe::WindowStarts v1
// (docs/onnxruntime-kernel.md): attribute, type and shape checks, output allocation, the intra-op
// thread pool, and the RegisterCustomOps entry point.
// Built against the C/C++ API with ORT_API_MANUAL_INIT; no onnxruntime library is linked.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "continuous_slice_ffn.h"
#ifdef INFMOE_WITH_CUDA
#include "continuous_slice_ffn_cuda.h"
#endif

namespace {

constexpr const char* kDomain = "infmoe";
// Session config entry: "0" registers only the ops that have a CUDA kernel (RegisterCustomOps).
constexpr const char* kCpuOnlyOpsKey = "infmoe.cpu_only_ops";

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// Thrown by the checks; Guard prefixes the op's name.
[[noreturn]] void Fail(const std::string& message) { throw Ort::Exception(std::string(message), ORT_INVALID_ARGUMENT); }

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

// Fails unless `shape` is `expected`, saying what it must be: `meaning` ("[H]"), or a function
// that writes it where it needs numbers, called only then (the checks run on every call).
template <class Meaning>
void RequireShape(const char* name, const std::vector<int64_t>& shape, std::initializer_list<int64_t> expected,
                  const Meaning& meaning) {
  if (std::equal(shape.begin(), shape.end(), expected.begin(), expected.end())) return;
  std::string text;
  if constexpr (std::is_invocable_v<const Meaning&>) text = meaning(); else text = meaning;
  Fail(std::string(name) + " " + ShapeString(shape) + " must be " + text + " = " + ShapeString(expected));
}

// `shape` with its last dimension `last` (an output's shape), in a buffer the calling thread keeps.
const std::vector<int64_t>& WithLast(const std::vector<int64_t>& shape, int64_t last) {
  thread_local std::vector<int64_t> out;
  out.assign(shape.begin(), shape.end());
  out.back() = last;
  return out;
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

// A required int64 attribute; missing or of another type is refused.
int64_t RequiredInt(const Ort::ConstKernelInfo& info, const char* name, const char* what) {
  try {
    return info.GetAttribute<int64_t>(name);
  } catch (const Ort::Exception&) {
    Fail(std::string("attribute '") + name + "' (an int, " + what + ") is required");
  }
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

// The required bits and block_size of the quantized ops (SPEC §6).
infmoe::Quantization QuantizationOf(const Ort::ConstKernelInfo& info) {
  const int64_t bits = RequiredInt(info, "bits", "4 or 8");
  if (bits != 4 && bits != 8) Fail("bits must be 4 or 8, got " + std::to_string(bits));
  const int64_t block = RequiredInt(info, "block_size", "a power of two >= 16");
  if (block < 16 || (block & (block - 1)) != 0) Fail("block_size must be a power of two >= 16, got " + std::to_string(block));
  return {bits, block};
}

struct QuantizedAttributes : Attributes {
  infmoe::Quantization quantization;
  explicit QuantizedAttributes(const OrtKernelInfo* info)
      : Attributes(info), quantization(QuantizationOf(Ort::ConstKernelInfo(info))) {}
};

// QMatMul's: K and N (MatMulNBits' names), bits and block_size.
struct MatMulAttributes {
  infmoe::Quantization quantization;
  int64_t k, n;
  explicit MatMulAttributes(const OrtKernelInfo* info) : quantization(QuantizationOf(Ort::ConstKernelInfo(info))) {
    Ort::ConstKernelInfo kernel_info(info);
    k = RequiredInt(kernel_info, "K", "A's last dimension");
    n = RequiredInt(kernel_info, "N", "the output's last dimension");
    if (k < 1 || n < 1) Fail("K and N must be >= 1, got K = " + std::to_string(k) + ", N = " + std::to_string(n));
  }
};

// Converts any exception into an OrtStatus: onnxruntime reports it, nothing unwinds through C.
template <typename Body>
OrtStatusPtr Guard(const char* op, Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const Ort::Exception& error) {
    return Ort::GetApi().CreateStatus(error.GetOrtErrorCode(), (std::string(op) + ": " + error.what()).c_str());
  } catch (const std::exception& error) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, (std::string(op) + ": " + error.what()).c_str());
  }
}

// Element type and shape of a tensor, into `type` and `shape` (its capacity reused).
void Describe(const Ort::ConstValue& value, ONNXTensorElementDataType& type, std::vector<int64_t>& shape) {
  const auto info = value.GetTensorTypeAndShapeInfo();
  type = info.GetElementType();
  shape.resize(info.GetDimensionsCount());
  Ort::ThrowOnError(Ort::GetApi().GetDimensions(info, shape.data(), shape.size()));  // GetShape() would allocate
}

// A kernel's constant initializer inputs (its weights), described once when the kernel is made:
// their types and shapes cannot change, and describing a tensor costs an allocation inside
// onnxruntime (0.08 us an input here, four of the expert op's six).
struct ConstantInputs {
  std::vector<bool> constant;
  std::vector<ONNXTensorElementDataType> types;
  std::vector<std::vector<int64_t>> shapes;

  ConstantInputs(const OrtKernelInfo* info, size_t count) : constant(count), types(count), shapes(count) {
    for (size_t i = 0; i < count; ++i) {
      int is_constant = 0;
      const OrtValue* value = nullptr;
      // An input the node does not have is not constant (onnxruntime answers false, or an error).
      Ort::Status status(Ort::GetApi().KernelInfoGetConstantInput_tensor(info, i, &is_constant, &value));
      if (!status.IsOK() || !is_constant || value == nullptr) continue;
      constant[i] = true;
      Describe(Ort::ConstValue(value), types[i], shapes[i]);
    }
  }
};

// An op's inputs, their element types and shapes (an absent optional input: type undefined, no
// shape, Data null).
struct Inputs {
  std::vector<Ort::ConstValue> values;
  std::vector<ONNXTensorElementDataType> types;
  std::vector<std::vector<int64_t>> shapes;

  // This call's inputs, in buffers the calling thread keeps: once grown, a call allocates nothing
  // here. Valid until the thread's next Read (a kernel's checks and computation, nothing nests).
  static const Inputs& Read(const Ort::KernelContext& context, const ConstantInputs& constants) {
    thread_local Inputs in;
    const size_t count = constants.constant.size();
    in.values.clear(), in.types.resize(count), in.shapes.resize(count);
    for (size_t i = 0; i < count; ++i) {
      in.values.push_back(context.GetInput(i));
      if (constants.constant[i]) {
        in.types[i] = constants.types[i], in.shapes[i] = constants.shapes[i];
      } else if (in.Present(i)) {
        Describe(in.values[i], in.types[i], in.shapes[i]);
      } else {
        in.types[i] = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, in.shapes[i].clear();
      }
    }
    return in;
  }
  bool Present(size_t i) const { return static_cast<const OrtValue*>(values[i]) != nullptr; }
  template <typename T>
  const T* Data(size_t i) const {
    return Present(i) ? reinterpret_cast<const T*>(values[i].GetTensorRawData()) : nullptr;
  }
};

// What Op asks of a kernel beyond its name and inputs: one required output of the op's type, every
// input required.
struct OneOutput {
  static constexpr size_t kOutputs = 1;
  static bool Optional(size_t) { return false; }
  static ONNXTensorElementDataType OutputType(size_t, ONNXTensorElementDataType x) { return x; }
};

// onnxruntime's intra-op pool as the computation's ParallelFor.
infmoe::ParallelFor ParallelForOf(const Ort::KernelContext& context) {
  return [&context](size_t n, const std::function<void(size_t)>& body) {
    if (n == 1) return body(0);
    auto call = [](void* data, size_t i) { (*static_cast<const std::function<void(size_t)>*>(data))(i); };
    context.ParallelFor(call, n, 0, const_cast<std::function<void(size_t)>*>(&body));
  };
}

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

const char* TypeName(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    default: return "another type";
  }
}

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

template <typename T>
struct QuantizedCpuKernel : OneOutput {
  static constexpr const char* kName = "QContinuousSliceFFN";
  static constexpr size_t kInputs = 8;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }

  QuantizedAttributes attributes;
  ConstantInputs constants;
  explicit QuantizedCpuKernel(const OrtKernelInfo* info) : attributes(info), constants(info, kInputs) {}

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

template <typename T>
struct QMatMulCpuKernel : OneOutput {
  static constexpr const char* kName = "QMatMul";
  static constexpr size_t kInputs = 3;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }

  MatMulAttributes attributes;
  ConstantInputs constants;
  explicit QMatMulCpuKernel(const OrtKernelInfo* info) : attributes(info), constants(info, kInputs) {}

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

// DecoderAttention: qkv [B, S, 3 H d], past_key and past_value [B, H, P, d] (optional: both or
// neither), seqlens_k int32 [B], total_sequence_length int32 [1], attention_bias [1 or B, 1, S, T],
// qkv_bias [3 H d] (optional); outputs y [B, S, H d], present_key and present_value [B, H, max(P, T), d].
// float32 only (the onnxruntime target's activations); the other inputs' types are checked here, by name.
constexpr const char* kAttentionNames[] = {"qkv", "past_key", "past_value", "seqlens_k", "total_sequence_length",
                                           "attention_bias", "qkv_bias"};

infmoe::AttentionSizes CheckAttention(const Inputs& in, int64_t heads, const int32_t*& seqlens_k) {
  const auto require_type = [&](size_t i, ONNXTensorElementDataType type) {
    if (in.types[i] != type) Fail(std::string(kAttentionNames[i]) + " must be " + TypeName(type) + ", got " + TypeName(in.types[i]));
  };
  for (size_t i : {1, 2, 5, 6}) {
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

struct AttentionCpuKernel {
  static constexpr const char* kName = "DecoderAttention";
  static constexpr size_t kInputs = 7, kOutputs = 3;
  static ONNXTensorElementDataType InputType(size_t index, ONNXTensorElementDataType x) {
    return index == 0 ? x : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  static bool Optional(size_t index) { return index == 1 || index == 2 || index == 6; }
  static ONNXTensorElementDataType OutputType(size_t, ONNXTensorElementDataType x) { return x; }

  int64_t heads;
  ConstantInputs constants;
  explicit AttentionCpuKernel(const OrtKernelInfo* info)
      : heads(RequiredInt(Ort::ConstKernelInfo(info), "num_heads", "the number of query, key and value heads")),
        constants(info, kInputs) {
    if (heads < 1) Fail("num_heads must be >= 1, got " + std::to_string(heads));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw_context) {
    return Guard(kName, [&] {
      Ort::KernelContext context(raw_context);
      const Inputs& inputs = Inputs::Read(context, constants);
      const int32_t* seqlens_k = nullptr;
      const infmoe::AttentionSizes s = CheckAttention(inputs, heads, seqlens_k);
      const int64_t output[] = {s.batch, s.sequence, s.heads * s.head_dim}, cache[] = {s.batch, s.heads, s.present, s.head_dim};
      Ort::UnownedValue y = context.GetOutput(0, output, 3);
      Ort::UnownedValue key = context.GetOutput(1, cache, 4), value = context.GetOutput(2, cache, 4);
      infmoe::DecoderAttention(s, inputs.Data<float>(0), inputs.Data<float>(1), inputs.Data<float>(2), seqlens_k,
                               inputs.Data<float>(5), inputs.Data<float>(6), y.GetTensorMutableData<float>(), key.GetTensorMutableData<float>(),
                               value.GetTensorMutableData<float>(), ParallelForOf(context));
    });
  }
};

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
      : h(RequiredInt(Ort::ConstKernelInfo(info), "ffn_hidden", "H, the expert's hidden units")),
        r(RequiredInt(Ort::ConstKernelInfo(info), "slice_width", "r, the window's width")),
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

template <typename Kernel, ONNXTensorElementDataType Type>
struct Op : Ort::CustomOpBase<Op<Kernel, Type>, Kernel, true> {
  explicit Op(const char* provider) : provider_(provider) {}

  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return Guard(Kernel::kName, [&] { *kernel = new Kernel(info); });
  }
  const char* GetName() const { return Kernel::kName; }
  const char* GetExecutionProviderType() const { return provider_; }
  size_t GetInputTypeCount() const { return Kernel::kInputs; }
  ONNXTensorElementDataType GetInputType(size_t index) const { return Kernel::InputType(index, Type); }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return Kernel::Optional(index) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return Kernel::kOutputs; }
  ONNXTensorElementDataType GetOutputType(size_t index) const { return Kernel::OutputType(index, Type); }

 private:
  const char* provider_;
};

// float16 travels as its 16 raw bits; the kernel converts to float.
Op<CpuKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_float(nullptr);
Op<CpuKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cpu_half(nullptr);
Op<QuantizedCpuKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_quantized_float(nullptr);
Op<QuantizedCpuKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cpu_quantized_half(nullptr);
Op<QMatMulCpuKernel<float>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_matmul_float(nullptr);
Op<QMatMulCpuKernel<uint16_t>, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> cpu_matmul_half(nullptr);
Op<AttentionCpuKernel, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_attention(nullptr);
Op<WindowStartsCpuKernel, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> cpu_window_starts(nullptr);
Op<StepInputsCpuKernel, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64> cpu_step_inputs(nullptr);
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
  return Guard("RegisterCustomOps", [&] {
    Ort::UnownedSessionOptions session_options(options);
    Ort::CustomOpDomain domain(kDomain);
    domain.Add(&cpu_float);
    domain.Add(&cpu_half);
    // The ops with a CPU kernel only are left out where the session asks so (runtimes/ort.py does
    // for a session with the CUDA provider): registered, they would pull their nodes onto the
    // CPU, since onnxruntime inlines a node's fallback function only when no provider claims
    // the node; left out, the function runs on the GPU (GroupQueryAttention, MatMulNBits).
    if (session_options.GetConfigEntryOrDefault(kCpuOnlyOpsKey, "1") != "0") {
      for (OrtCustomOp* op : std::initializer_list<OrtCustomOp*>{&cpu_quantized_float, &cpu_quantized_half, &cpu_matmul_float,
                                                                 &cpu_matmul_half, &cpu_attention, &cpu_window_starts,
                                                                 &cpu_step_inputs}) {
        domain.Add(op);
      }
    }
#ifdef INFMOE_WITH_CUDA
    domain.Add(&cuda_float);
    domain.Add(&cuda_half);
#endif
    session_options.Add(domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  });
}
