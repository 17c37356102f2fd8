"""The TensorRT plugins' side: the Triton ContinuousSliceFFN kernel and its registration with
TensorRT (docs/design/tensorrt.md).

    triton_kernel  the Triton-language kernels (float and quantized) and their launchers; needs
                   only triton and torch, so it is also the op on PyTorch CUDA tensors
    compile        the kernel as PTX for an engine (the AOT plugin)
    cuda_driver    what libcuda says about the GPU and driver
    descriptors    the plugins' shape, type and attribute rules as plain functions
    register       registers `infmoe::ContinuousSliceFFN` and `infmoe::QContinuousSliceFFN` with
                   TensorRT's Python plugin API when imported (tensorrt >= 10.9, < 12)

Nothing here is imported by the package's __init__: each module's dependencies load only when
it is imported.
"""
