"""config.pbtxt for each model of the repository, checked against Triton's own schema
(tritonclient.grpc.model_config_pb2) before it is written: text_format parses strictly, so an
unknown field, a wrong type or a misspelt enum is an error, never silently ignored."""

import json
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..contract import DecoderIO
from ..errors import InfMoEError

FRONT_MODEL = "infmoe"
GENERATE_MODEL = "infmoe_generate"
# The front model holds the KV cache of this many sequences at once and steps them in one
# onnxruntime call; Triton keeps further sequences waiting until one ends.
MAX_BATCH = 16
IDLE_SECONDS = 60
# Only where no preferred batch size fits the requests waiting (preferred sizes without 1)
# does the batcher wait for more, this long at most.
MAX_QUEUE_DELAY_US = 500
# Triton's data types of the per-K models' inputs and outputs (DecoderIO.dtypes), by numpy name.
TRITON_TYPES = {"int64": "TYPE_INT64", "float32": "TYPE_FP32", "float16": "TYPE_FP16"}


def require_schema():
    """Triton's ModelConfig message class (from the `serve` extra)."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise InfMoEError("serving needs tritonclient: pip install 'infmoe-export[serve]'") from None
    return model_config_pb2


def validate(text: str, where: str):
    """Parse config.pbtxt text with Triton's schema; an InfMoEError naming `where` if it does not."""
    from google.protobuf import text_format

    model_config_pb2 = require_schema()
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as error:
        raise InfMoEError(f"{where}: config.pbtxt does not parse with Triton's schema: {error}") from None


def model_name(k: int, precision: str, backend: str = "onnx") -> str:
    return f"infmoe_k{k}_{precision}" + ("_trt" if backend == "trt" else "")


def _dims(shape) -> str:
    return ", ".join(str(d) if isinstance(d, int) else "-1" for d in shape)


def _tensor(name: str, dtype: str, shape) -> str:
    return f'  {{ name: "{name}" data_type: {dtype} dims: [ {_dims(shape)} ] }}'


def _io_blocks(decoder_io: DecoderIO) -> str:
    """input/output blocks of a per-K model, batch dim included in dims (max_batch_size 0):
    the cache's batch and past dims are dynamic, which Triton's own batching cannot split."""
    shapes = decoder_io.shapes()
    types = {name: TRITON_TYPES[np.dtype(t).name] for name, t in decoder_io.dtypes().items()}
    inputs = ",\n".join(_tensor(n, types[n], shapes[n]) for n in decoder_io.input_names)
    outputs = ",\n".join(_tensor(n, types[n], shapes[n]) for n in decoder_io.output_names)
    return f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"


def onnx_model_config(name: str, decoder_io: DecoderIO, library: Optional[str]) -> str:
    """An onnxruntime-backend model; `library` is the kernel's path as the server sees it."""
    ops = f'model_operations {{ op_library_filename: [ "{library}" ] }}\n' if library else ""
    return (f'name: "{name}"\nbackend: "onnxruntime"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
            f"{_io_blocks(decoder_io)}{ops}"
            'instance_group [ { count: 1 kind: KIND_CPU } ]\n'
            'parameters { key: "infmoe.k" value { string_value: "%d" } }\n' % decoder_io.k)


def tensorrt_model_config(name: str, decoder_io: DecoderIO) -> str:
    """A TensorRT-backend model (an engine of `infmoe-export trt`, copied as 1/model.plan)."""
    return (f'name: "{name}"\nbackend: "tensorrt"\nplatform: "tensorrt_plan"\nmax_batch_size: 0\n'
            f"{_io_blocks(decoder_io)}"
            'instance_group [ { count: 1 kind: KIND_GPU } ]\n'
            'parameters { key: "infmoe.k" value { string_value: "%d" } }\n' % decoder_io.k)


def front_model_config(models: Dict[str, Dict[str, str]], decoder_io: DecoderIO, executor: str = "local",
                       default_precision: str = "fp32", *, preferred_batch_sizes: Sequence[int]) -> str:
    """The decoding front model (Python backend, sequence batching, oldest-first strategy so that
    the steps of different sequences are batched together, at most MAX_BATCH sequences live, the
    preferred batch sizes those of batching.preferred_batch_sizes). `models` maps "K/precision" to
    {"onnx": path relative to the repository, "triton": the per-K model's name}; the expert
    budget and precision are request parameters (`k`, `precision`, default default_precision)."""
    preferred = ", ".join(str(b) for b in sorted(set(preferred_batch_sizes)))
    return f"""name: "{FRONT_MODEL}"
backend: "python"
max_batch_size: {MAX_BATCH}
input [
  {{ name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true }}
]
output [
  {{ name: "NEXT_TOKEN" data_type: TYPE_INT64 dims: [ 1 ] }},
  {{ name: "LOGITS" data_type: TYPE_FP32 dims: [ {decoder_io.config.vocab_size} ] }}
]
sequence_batching {{
  max_sequence_idle_microseconds: {IDLE_SECONDS * 1_000_000}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  oldest {{ max_candidate_sequences: {MAX_BATCH} preferred_batch_size: [ {preferred} ]
           max_queue_delay_microseconds: {MAX_QUEUE_DELAY_US} }}
}}
{_front_parameters(models, decoder_io, executor, default_precision, preferred_batch_sizes, "step")}"""


def generate_model_config(models: Dict[str, Dict[str, str]], decoder_io: DecoderIO, executor: str = "local",
                          default_precision: str = "fp32", *, preferred_batch_sizes: Sequence[int]) -> str:
    """The generate model: the front model's file and routes as a decoupled model (Triton's
    model_transaction_policy), one request a whole generation, its tokens streamed back; at most
    MAX_BATCH generations live a route, stepped together in calls of the preferred batch sizes."""
    return f"""name: "{GENERATE_MODEL}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] }}
]
output [
  {{ name: "NEXT_TOKEN" data_type: TYPE_INT64 dims: [ 1 ] }}
]
{_front_parameters(models, decoder_io, executor, default_precision, preferred_batch_sizes, "generate")}"""


def _front_parameters(models, decoder_io: DecoderIO, executor: str, default_precision: str,
                      preferred_batch_sizes: Sequence[int], mode: str) -> str:
    """The instance group and parameters that the front and generate models share."""
    values = {"mode": mode, "routes": json.dumps(models, sort_keys=True), "executor": executor,
              "default_precision": default_precision, "n_positions": decoder_io.config.n_positions,
              "vocab_size": decoder_io.config.vocab_size, "rows": MAX_BATCH,
              "preferred_batch_sizes": json.dumps(sorted(set(preferred_batch_sizes))),
              "input_names": json.dumps(decoder_io.input_names), "output_names": json.dumps(decoder_io.output_names),
              "idle_seconds": IDLE_SECONDS}
    parameters = "".join(f'parameters {{ key: "{key}" value {{ string_value: "{_quote(str(value))}" }} }}\n'
                         for key, value in values.items())
    return "instance_group [ { count: 1 kind: KIND_CPU } ]\n" + parameters


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def routes_of(config) -> Dict[str, Dict[str, str]]:
    """The routes table of a parsed front-model ModelConfig."""
    return json.loads(config.parameters["routes"].string_value)


def names(configs: List) -> List[str]:
    return [c.name for c in configs]
