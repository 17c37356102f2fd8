"""TensorRT plugins `infmoe::ContinuousSliceFFN` and `infmoe::QContinuousSliceFFN` (TensorRT >= 10.9
Python plugins, `tensorrt.plugin`).

Importing this module registers both. The ONNX parser maps a node to one by op type
(ContinuousSliceFFN or QContinuousSliceFFN) + attributes plugin_namespace "infmoe" and
plugin_version "1", as long as the model has no local function of that name (export with
--no-function); it passes the node's slice_width and activation (and bits and block_size)
attributes as plugin fields.

Two implementations, chosen per build by a network flag:
- AOT (default, PREFER_AOT_PYTHON_PLUGINS): the Triton kernel compiled to PTX at build time and
  baked into the engine, so the engine runs without Python (trtexec, C++).
- JIT (PREFER_JIT_PYTHON_PLUGINS, `infmoe-export trt --jit`): a Python callback that launches the
  same kernel, in the same COLUMNS mode, on TensorRT's stream; for debugging.

Neither checks the starts' values on the host: TensorRT times plugins on made-up inputs while
it builds, and a host read would also break CUDA-graph capture. The kernel clamps every start
to stay inside the weights and marks a token with a start outside [0, H - r] (see triton_kernel.py).

TensorRT validates every function's signature when this module is imported: tensors first,
then the attributes in registration order, then `outputs` and `stream` (impl) or `tactic`
(aot_impl), with the return annotations written here. tests/test_tensorrt.py checks them.
"""

from typing import List, Tuple, Union

import tensorrt as trt
import tensorrt.plugin as trtp

from . import descriptors
from .compile import columns_constants, columns_grid_y, compile_ptx

ID, Q_ID = descriptors.FLOAT_OP.plugin_id, descriptors.Q_OP.plugin_id
DTYPE_NAMES = {trt.float32: "float32", trt.float16: "float16", trt.int64: "int64", trt.int32: "int32",
               trt.int8: "int8"}
PTX_TYPES = {trt.float32: "fp32", trt.float16: "fp16"}


def _dtype_name(desc) -> str:
    return DTYPE_NAMES.get(desc.dtype, str(desc.dtype))


def _static_dims(desc) -> Tuple:
    """Each dim as an int where TensorRT knows it at build time, else None."""
    return tuple(dim.constant_value() if not dim.is_fake and dim.is_constant else None for dim in desc.shape_expr)


def _output_desc(op, inputs):
    descriptors.check_ranks([len(t.shape_expr) for t in inputs], op)
    descriptors.output_dtype([_dtype_name(t) for t in inputs], op)
    return inputs[0].like()  # Y is shaped and typed like X


def _launch_jit(kernel, inputs, output, stream: int, spec: dict, **quant) -> None:
    """The COLUMNS kernel on TensorRT's buffers and stream (needs a CUDA build of torch)."""
    import torch

    from .triton_kernel import NUM_WARPS

    tokens = inputs[0].numel() // spec["D"]
    if tokens == 0:
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        tensors = [torch.as_tensor(t, device="cuda") for t in (*inputs, output)]
        kernel[(tokens, columns_grid_y(spec["D"]))](*tensors, **columns_constants(**spec, **quant),
                                                     num_warps=NUM_WARPS)


def _aot(inputs, spec: dict, **quant):
    """Kernel name, PTX, launch parameters and (no) extra scalars for TensorRT's AOT path."""
    X = inputs[0]
    kernel = compile_ptx(PTX_TYPES[X.dtype], **spec, **quant)
    launch = trtp.KernelLaunchParams()
    launch.grid_x = X.shape_expr.numel() // spec["D"]  # one program row per token
    launch.grid_y = kernel["grid_y"]
    launch.block_x = kernel["block_x"]
    launch.shared_mem = kernel["shared_mem"]
    # The kernel takes no scalar arguments: pointers to the inputs, then to Y.
    return kernel["name"], kernel["ptx"], launch, trtp.SymIntExprs(0)


# ---------------------------------------------------------------------------------------------
# infmoe::ContinuousSliceFFN (SPEC §4)


@trtp.register(ID)
def continuous_slice_ffn_desc(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in: trtp.TensorDesc,
                              b_in: trtp.TensorDesc, w_out: trtp.TensorDesc, b_out: trtp.TensorDesc,
                              slice_width: int, activation: str) -> trtp.TensorDesc:
    descriptors.check_attributes(slice_width, activation)
    return _output_desc(descriptors.FLOAT_OP, (X, starts, w_in, b_in, w_out, b_out))


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
    from .triton_kernel import continuous_slice_ffn_kernel

    inputs = (X, starts, w_in, b_in, w_out, b_out)
    spec = descriptors.specialisation([tuple(t.shape) for t in inputs], slice_width)
    _launch_jit(continuous_slice_ffn_kernel, inputs, outputs[0], stream, spec)


@trtp.aot_impl(ID)
def continuous_slice_ffn_aot(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in: trtp.TensorDesc,
                             b_in: trtp.TensorDesc, w_out: trtp.TensorDesc, b_out: trtp.TensorDesc,
                             slice_width: int, activation: str, outputs: Tuple[trtp.TensorDesc], tactic: int
                             ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    inputs = (X, starts, w_in, b_in, w_out, b_out)
    return _aot(inputs, descriptors.specialisation([_static_dims(t) for t in inputs], slice_width))


# ---------------------------------------------------------------------------------------------
# infmoe::QContinuousSliceFFN (SPEC §6): packed weights as int8 (network.plugin_model), block scales


@trtp.register(Q_ID)
def q_continuous_slice_ffn_desc(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in_q: trtp.TensorDesc,
                                w_in_scale: trtp.TensorDesc, b_in: trtp.TensorDesc, w_out_q: trtp.TensorDesc,
                                w_out_scale: trtp.TensorDesc, b_out: trtp.TensorDesc, slice_width: int,
                                activation: str, bits: int, block_size: int) -> trtp.TensorDesc:
    descriptors.check_q_attributes(slice_width, activation, bits, block_size)
    return _output_desc(descriptors.Q_OP, (X, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out))


@trtp.autotune(Q_ID)
def q_continuous_slice_ffn_autotune(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in_q: trtp.TensorDesc,
                                    w_in_scale: trtp.TensorDesc, b_in: trtp.TensorDesc, w_out_q: trtp.TensorDesc,
                                    w_out_scale: trtp.TensorDesc, b_out: trtp.TensorDesc,
                                    outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    # X, scales, biases and Y all float32 or all float16; the packed weights int8.
    return [trtp.AutoTuneCombination(
        "FP32|FP16, INT64, INT8, FP32|FP16, FP32|FP16, INT8, FP32|FP16, FP32|FP16, FP32|FP16")]


@trtp.impl(Q_ID)
def q_continuous_slice_ffn_jit(X: trtp.Tensor, starts: trtp.Tensor, w_in_q: trtp.Tensor, w_in_scale: trtp.Tensor,
                               b_in: trtp.Tensor, w_out_q: trtp.Tensor, w_out_scale: trtp.Tensor, b_out: trtp.Tensor,
                               slice_width: int, activation: str, bits: int, block_size: int,
                               outputs: Tuple[trtp.Tensor], stream: int) -> None:
    from .triton_kernel import q_continuous_slice_ffn_kernel

    inputs = (X, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out)
    spec = descriptors.specialisation([tuple(t.shape) for t in inputs], slice_width, bits, block_size)
    _launch_jit(q_continuous_slice_ffn_kernel, inputs, outputs[0], stream, spec, bits=bits, block_size=block_size)


@trtp.aot_impl(Q_ID)
def q_continuous_slice_ffn_aot(X: trtp.TensorDesc, starts: trtp.TensorDesc, w_in_q: trtp.TensorDesc,
                               w_in_scale: trtp.TensorDesc, b_in: trtp.TensorDesc, w_out_q: trtp.TensorDesc,
                               w_out_scale: trtp.TensorDesc, b_out: trtp.TensorDesc, slice_width: int,
                               activation: str, bits: int, block_size: int, outputs: Tuple[trtp.TensorDesc],
                               tactic: int
                               ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    inputs = (X, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out)
    spec = descriptors.specialisation([_static_dims(t) for t in inputs], slice_width, bits, block_size)
    return _aot(inputs, spec, bits=bits, block_size=block_size)
