// The library's one entry point: RegisterCustomOps adds every op of the infmoe domain
// (ops/*/op.cc) to a session.
#include <mutex>

#include "common/ort_glue.h"

namespace {

constexpr const char* kDomain = "infmoe";
// Session config entry: "0" registers only the ops that have a CUDA kernel (RegisterCustomOps).
constexpr const char* kCpuOnlyOpsKey = "infmoe.cpu_only_ops";
// Session config entry: "int8" gives the quantized ops int8 activations (common/int8_dots.h);
// "float" (the default) keeps SPEC §6's float activations.
constexpr const char* kActivationsKey = "infmoe.activations";

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
  return infmoe::ort::Guard("RegisterCustomOps", [&] {
    Ort::UnownedSessionOptions session_options(options);
    Ort::CustomOpDomain domain(kDomain);
    using namespace infmoe::ort;
    const std::string activations = session_options.GetConfigEntryOrDefault(kActivationsKey, "float");
    if (activations != "float" && activations != "int8") {
      Fail(std::string(kActivationsKey) + " must be float or int8, got '" + activations + "'");
    }
    const bool int8_activations = activations == "int8";
    for (OrtCustomOp* op : ContinuousSliceFFNOps()) domain.Add(op);
    // The ops with a CPU kernel only are left out where the session asks so (runtimes/ort.py does
    // for a session with the CUDA provider): registered, they would pull their nodes onto the
    // CPU, since onnxruntime inlines a node's fallback function only when no provider claims
    // the node; left out, the function runs on the GPU (GroupQueryAttention, MatMulNBits).
    if (session_options.GetConfigEntryOrDefault(kCpuOnlyOpsKey, "1") != "0") {
      for (const auto& ops : {QContinuousSliceFFNOps(int8_activations), QMatMulOps(int8_activations), DecoderAttentionOps(), WindowStartsOps(), StepInputsOps(),
                              SkipLayerNormOps()}) {
        for (OrtCustomOp* op : ops) domain.Add(op);
      }
    }
    for (OrtCustomOp* op : ContinuousSliceFFNCudaOps()) domain.Add(op);
    session_options.Add(domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  });
}
