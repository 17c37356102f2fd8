"""TensorRT: one engine per expert budget K and precision, a JSON manifest, and a Polygraphy runner.

`infmoe-export trt` exports (or takes) one ONNX model per (K, precision) without the fallback
local function, so the parser maps each ContinuousSliceFFN / QContinuousSliceFFN node to the
plugin of that name (`plugin/`), and builds each engine through Polygraphy with
two optimization profiles (prefill and decode) and one timing cache shared by all builds.

    availability  which TensorRT is installed and supported; registering the plugin
    network       the model checked and prepared for the parser, network flags, profiles
    manifest      manifest.json and engine selection by (K, precision)
    build         the build plan, builder configuration and builds
    runner        TrtRunner
    plugin/       the Triton kernel and the TensorRT plugins it backs

Everything except building and running engines works without TensorRT.
"""

from .availability import require_tensorrt, tensorrt_available, tensorrt_problem, tensorrt_version
from .build import build_engines, plan_models
from .manifest import read_manifest, select_engine
from .runner import TrtRunner

__all__ = ["TrtRunner", "build_engines", "plan_models", "read_manifest", "require_tensorrt", "select_engine",
           "tensorrt_available", "tensorrt_problem", "tensorrt_version"]
