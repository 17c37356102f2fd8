"""infmoe_trt: the Triton ContinuousSliceFFN kernel and its TensorRT plugin (see docs/tensorrt.md).

`kernel` needs only triton and torch; `compile` turns it into PTX for a TensorRT engine;
`cuda_driver` asks libcuda about the GPU and driver; `plugin` registers
`infmoe::ContinuousSliceFFN` with TensorRT's Python plugin API when imported and needs
tensorrt >= 10.9, < 12.
"""
