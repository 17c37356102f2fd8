"""TensorRT plugin `infmoe::ContinuousSliceFFN` (TensorRT >= 10.9 Python plugins, `tensorrt.plugin`).

Importing this module registers the plugin. The ONNX parser maps a node to it by op type
(ContinuousSliceFFN) + attributes plugin_namespace "infmoe" and plugin_version "1", as long as
the model has no local function of that name (export with --no-function); it passes the node's
slice_width and activation attributes as plugin fields.

Two implementations, chosen per build by a network flag:
- AOT (default, PREFER_AOT_PYTHON_PLUGINS): the Triton kernel compiled to PTX at build time and
  baked into the engine, so the engine runs without Python (trtexec, C++).
- JIT (PREFER_JIT_PYTHON_PLUGINS, `infmoe-export trt --jit`): a Python callback that launches the
  same kernel, in the same COLUMNS mode, on TensorRT's stream; for debugging.

Neither checks the starts' values on the host: TensorRT times plugins on made-up inputs while
it builds, and a host read would also break CUDA-graph capture. The kernel clamps every start
to stay inside the weights and marks a token with a start outside [0, H - r] (see kernel.py).

TensorRT validates every function's signature when this module is imported: tensors first,
then the attributes in registration order, then `outputs` and `stream` (impl) or `tactic`
(aot_impl), with the return annotations written here. tests/test_tensorrt.py checks them.
"""

from typing import List, Tuple, Union

import tensorrt as trt
import tensorrt.plugin as trtp

from . import descriptors
from .compile import columns_constants, columns_grid_y, compile_ptx

ID = descriptors.PLUGIN_ID
DTYPE_NAMES = {trt.float32: "float32", trt.float16: "float16", trt.int64: "int64", trt.int32: "int32"}
PTX_TYPES = {trt.float32: "fp32", trt.float16: "fp16"}


def _dtype_name(desc) -> str:
    return DTYPE_NAMES.get(desc.dtype, str(desc.dtype))


def _static_dims(desc) -> Tuple:
    """Each dim as an int where TensorRT knows it at build time, else None."""
    return tuple(dim.constant_value() if not dim.is_fake and dim.is_constant else None for dim in desc.shape_expr)


@trtp.register(ID)
def continuous_slice_ffn_desc(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in: trtp.TensorDesc,
                              b_in: trtp.TensorDesc, w_out: trtp.TensorDesc, b_out: trtp.TensorDesc,
                              slice_width: int, activation: str) -> trtp.TensorDesc:
    inputs = (X, starts, w_in, b_in, w_out, b_out)
    descriptors.check_attributes(slice_width, activation)
    descriptors.check_ranks([len(t.shape_expr) for t in inputs])
    descriptors.output_dtype([_dtype_name(t) for t in inputs])
    return X.like()  # Y is shaped and typed like X


@trtp.autotune(ID)
def continuous_slice_ffn_autotune(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in: trtp.TensorDesc,
                                  b_in: trtp.TensorDesc, w_out: trtp.TensorDesc, b_out: trtp.TensorDesc,
                                  outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    # X, the weights and Y all float32 or all float16; a strongly typed network fixes which.
    return [trtp.AutoTuneCombination("FP32|FP16, INT64, FP32|FP16, FP32|FP16, FP32|FP16, FP32|FP16, FP32|FP16")]


@trtp.impl(ID)
def continuous_slice_ffn_jit(X: trtp.Tensor, starts: trtp.Tensor, w_in: trtp.Tensor, b_in: trtp.Tensor,
                             w_out: trtp.Tensor, b_out: trtp.Tensor, slice_width: int, activation: str,
                             outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from .kernel import NUM_WARPS, continuous_slice_ffn_kernel

    inputs = (X, starts, w_in, b_in, w_out, b_out)
    spec = descriptors.specialisation([tuple(t.shape) for t in inputs], slice_width)
    tokens = X.numel() // spec["D"]
    if tokens == 0:
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        tensors = [torch.as_tensor(t, device="cuda") for t in (*inputs, outputs[0])]
        continuous_slice_ffn_kernel[(tokens, columns_grid_y(spec["D"]))](
            *tensors, **columns_constants(**spec), num_warps=NUM_WARPS)


@trtp.aot_impl(ID)
def continuous_slice_ffn_aot(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in: trtp.TensorDesc,
                             b_in: trtp.TensorDesc, w_out: trtp.TensorDesc, b_out: trtp.TensorDesc,
                             slice_width: int, activation: str, outputs: Tuple[trtp.TensorDesc], tactic: int
                             ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    inputs = (X, starts, w_in, b_in, w_out, b_out)
    spec = descriptors.specialisation([_static_dims(t) for t in inputs], slice_width)
    kernel = compile_ptx(PTX_TYPES[X.dtype], **spec)
    launch = trtp.KernelLaunchParams()
    launch.grid_x = X.shape_expr.numel() // spec["D"]  # one program row per token
    launch.grid_y = kernel["grid_y"]
    launch.block_x = kernel["block_x"]
    launch.shared_mem = kernel["shared_mem"]
    # The kernel takes no scalar arguments: pointers to the six inputs, then to Y.
    return kernel["name"], kernel["ptx"], launch, trtp.SymIntExprs(0)
