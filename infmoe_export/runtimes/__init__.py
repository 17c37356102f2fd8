"""Runtimes: onnxruntime (with the compiled kernel), TensorRT, generation."""
