"""infmoe_trt: the Triton ContinuousSliceFFN kernel and its TensorRT plugin (see docs/tensorrt.md).

`kernel` needs only triton and torch; `plugin` registers `infmoe::ContinuousSliceFFN` with
TensorRT's Python plugin API when imported and needs tensorrt >= 10.7.
"""
