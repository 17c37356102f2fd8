"""ONNX export of ∞-MoE models: the exporter and the standard-op fallback function.

Depends on the model and the contract only; checking an export against PyTorch is verify/'s job.
"""

from .exporter import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, export_many, export_onnx, model_filename
from .quantized import QDQ_OPSET

__all__ = ["DEFAULT_OPSET", "MAX_OPSET", "MIN_OPSET", "QDQ_OPSET", "export_many", "export_onnx", "model_filename"]
