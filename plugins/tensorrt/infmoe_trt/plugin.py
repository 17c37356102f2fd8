"""TensorRT plugin `infmoe::ContinuousSliceFFN` (TensorRT >= 10.7 Python plugins, `tensorrt.plugin`).

Importing this module registers the plugin. The ONNX parser maps a node to it by op type
(ContinuousSliceFFN) + attributes plugin_namespace "infmoe" and plugin_version "1", as long as
the model has no local function of that name (export with --no-function); it passes the node's
slice_width and activation attributes as plugin fields.

Two implementations, chosen per build by a network flag:
- AOT (default, PREFER_AOT_PYTHON_PLUGINS): the Triton kernel compiled to PTX at build time and
  baked into the engine, so the engine runs without Python (trtexec, C++).
- JIT (PREFER_JIT_PYTHON_PLUGINS, `infmoe-export trt --jit`): a Python callback that launches the
  same kernel through the launcher, with its input checks (start range included); for debugging.
"""

from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from . import descriptors
from .kernel import compile_ptx, continuous_slice_ffn_triton

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
    return X.like()  # output_shape / output_dtype: Y is shaped and typed like X


@trtp.autotune(ID)
def continuous_slice_ffn_autotune(X, starts, w_in, b_in, w_out, b_out, outputs):
    # X, the weights and Y all float32 or all float16 (an --fp16 build may pick the latter).
    return [trtp.AutoTuneCombination("FP32|FP16, INT64, FP32|FP16, FP32|FP16, FP32|FP16, FP32|FP16, FP32|FP16")]


@trtp.impl(ID)
def continuous_slice_ffn_jit(X: trtp.Tensor, starts: trtp.Tensor, w_in: trtp.Tensor, b_in: trtp.Tensor,
                             w_out: trtp.Tensor, b_out: trtp.Tensor, slice_width: int, activation: str,
                             outputs: Tuple[trtp.Tensor], stream: int) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        tensors = [torch.as_tensor(t, device="cuda") for t in (X, starts, w_in, b_in, w_out, b_out)]
        y = continuous_slice_ffn_triton(*tensors, slice_width, deterministic=True)
        torch.as_tensor(outputs[0], device="cuda").copy_(y)


@trtp.aot_impl(ID)
def continuous_slice_ffn_aot(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in: trtp.TensorDesc,
                             b_in: trtp.TensorDesc, w_out: trtp.TensorDesc, b_out: trtp.TensorDesc,
                             slice_width: int, activation: str, outputs: Tuple[trtp.TensorDesc], tactic: int):
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
