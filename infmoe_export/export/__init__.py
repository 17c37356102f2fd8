"""ONNX export of ∞-MoE models: the exporter, the fallback function, I/O names, validation."""

from .exporter import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, export_onnx
from .io import DecoderIO, model_io, read_metadata

__all__ = ["DEFAULT_OPSET", "MAX_OPSET", "MIN_OPSET", "DecoderIO", "export_onnx", "model_io", "read_metadata",
           "validate_onnx"]


def __getattr__(name):
    # validate imports onnxruntime; only load it when asked for.
    if name == "validate_onnx":
        from .validate import validate_onnx
        return validate_onnx
    raise AttributeError(name)
