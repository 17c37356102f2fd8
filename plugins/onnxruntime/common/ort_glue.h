// onnxruntime glue shared by every op's kernel (ops/*/op.cc): checks that fail with the op's
// name, the inputs of a call, the intra-op thread pool, and the custom-op description (Op).
// Built against the C/C++ API with ORT_API_MANUAL_INIT; no onnxruntime library is linked
// (register.cc initialises the API).
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "common/kernel.h"

namespace infmoe {
namespace ort {

inline std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// Thrown by the checks; Guard prefixes the op's name.
[[noreturn]] inline void Fail(const std::string& message) { throw Ort::Exception(std::string(message), ORT_INVALID_ARGUMENT); }

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
inline const std::vector<int64_t>& WithLast(const std::vector<int64_t>& shape, int64_t last) {
  thread_local std::vector<int64_t> out;
  out.assign(shape.begin(), shape.end());
  out.back() = last;
  return out;
}

// A required attribute of type T (int64_t or float); missing or of another type is refused.
template <typename T>
T RequiredAttribute(const Ort::ConstKernelInfo& info, const char* name, const char* what) {
  try {
    return info.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    Fail(std::string("attribute '") + name + "' (" + (std::is_same_v<T, float> ? "a float, " : "an int, ") + what +
         ") is required");
  }
}

// The required bits and block_size of the quantized ops (SPEC §6).
inline infmoe::Quantization QuantizationOf(const Ort::ConstKernelInfo& info) {
  const int64_t bits = RequiredAttribute<int64_t>(info, "bits", "4 or 8");
  if (bits != 4 && bits != 8) Fail("bits must be 4 or 8, got " + std::to_string(bits));
  const int64_t block = RequiredAttribute<int64_t>(info, "block_size", "a power of two >= 16");
  if (block < 16 || (block & (block - 1)) != 0) Fail("block_size must be a power of two >= 16, got " + std::to_string(block));
  return {bits, block};
}

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
inline void Describe(const Ort::ConstValue& value, ONNXTensorElementDataType& type, std::vector<int64_t>& shape) {
  const auto info = value.GetTensorTypeAndShapeInfo();
  type = info.GetElementType();
  shape.resize(info.GetDimensionsCount());
  Ort::ThrowOnError(Ort::GetApi().GetDimensions(info, shape.data(), shape.size()));  // GetShape() would allocate
}

// A kernel's constant initializer inputs (its weights), described once when the kernel is made:
// their types and shapes cannot change, and describing a tensor costs an allocation inside
// onnxruntime (four of the expert op's six inputs).
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
  static bool OptionalOutput(size_t) { return false; }
  static ONNXTensorElementDataType OutputType(size_t, ONNXTensorElementDataType x) { return x; }
};

// onnxruntime's intra-op pool as the computation's ParallelFor.
inline infmoe::ParallelFor ParallelForOf(const Ort::KernelContext& context) {
  return [&context](size_t n, const std::function<void(size_t)>& body) {
    if (n == 1) return body(0);
    auto call = [](void* data, size_t i) { (*static_cast<const std::function<void(size_t)>*>(data))(i); };
    context.ParallelFor(call, n, 0, const_cast<std::function<void(size_t)>*>(&body));
  };
}

inline const char* TypeName(ONNXTensorElementDataType type) {
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
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return Kernel::OptionalOutput(index) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }

 private:
  const char* provider_;
};

// The custom ops one op's file adds to the infmoe domain (register.cc); int8_activations: the
// session's option infmoe.activations is int8.
std::vector<OrtCustomOp*> ContinuousSliceFFNOps();
std::vector<OrtCustomOp*> ContinuousSliceFFNCudaOps();
std::vector<OrtCustomOp*> QContinuousSliceFFNOps(bool int8_activations);
std::vector<OrtCustomOp*> QMatMulOps(bool int8_activations);
std::vector<OrtCustomOp*> DecoderAttentionOps();
std::vector<OrtCustomOp*> WindowStartsOps();
std::vector<OrtCustomOp*> SkipLayerNormOps();
std::vector<OrtCustomOp*> StepInputsOps();

}  // namespace ort
}  // namespace infmoe
