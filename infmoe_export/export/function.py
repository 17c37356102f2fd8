"""The ONNX local function `infmoe::ContinuousSliceFFN` (SPEC §4): the op in standard ops only.

Every exported model carries it, so a runtime without the compiled kernel still runs the model.
It is the reference's dense form: all H hidden units, each weighted by its coverage
c_i = (windows covering unit i) / K, built from Range and comparisons. GELU is written out
(tanh form) because ONNX has Gelu only from opset 20 and the exporter supports 18 and up.
"""

import math

import onnx_ir as ir
from onnx import TensorProto, helper
from onnxscript import script, values
from onnxscript import opset18 as op

from ..contract import DOMAIN, OP_TYPE, OP_VERSION

infmoe = values.Opset(DOMAIN, OP_VERSION)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@script(infmoe, default_opset=op)
def ContinuousSliceFFN(X, starts, w_in, b_in, w_out, b_out, slice_width: int, activation: str,
                       plugin_namespace: str, plugin_version: str):
    # The last three attributes only identify the op (TensorRT plugin lookup); the body needs r.
    units = op.Range(0, op.Squeeze(op.Shape(w_in, start=0, end=1), [0]), 1)   # [H]
    s = op.Unsqueeze(starts, [-1])                                                # [..., K, 1]
    inside = op.And(op.GreaterOrEqual(units, s), op.Less(units, s + slice_width))  # [..., K, H]
    weight = op.ReduceMean(op.CastLike(inside, X), [-2], keepdims=0)              # [..., H]
    a = op.MatMul(X, op.Transpose(w_in, perm=[1, 0])) + b_in
    c = op.CastLike(_SQRT_2_OVER_PI, X)
    gelu = op.CastLike(0.5, X) * a * (op.CastLike(1.0, X) + op.Tanh(c * (a + op.CastLike(0.044715, X) * a * a * a)))
    Y = op.MatMul(gelu * weight, w_out) + b_out
    return Y


def ir_function(opset: int) -> ir.Function:
    """The function as an onnx_ir Function for a model of this opset (the checker wants a
    function's default opset to match the model's; every op here means the same from 18 on,
    later opsets only add types)."""
    function = ir.serde.deserialize_function(ContinuousSliceFFN.to_function_proto())
    function.opset_imports[""] = opset
    return function


def op_model(slice_width: int, dtype: str = "float32", activation: str = "gelu_tanh", with_function: bool = False):
    """A one-node ONNX model of the op, every input of free shape (tests, fuzzing, benchmarks).

    with_function attaches the standard-op fallback function, which onnxruntime runs when the
    kernel library is not registered."""
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    names = ["X", "starts", "w_in", "b_in", "w_out", "b_out"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "starts" else elem, None) for n in names]
    node = helper.make_node(OP_TYPE, names, ["Y"], domain=DOMAIN, slice_width=slice_width, activation=activation,
                            plugin_namespace=DOMAIN, plugin_version=str(OP_VERSION))
    graph = helper.make_graph([node], "continuous_slice_ffn", inputs, [helper.make_tensor_value_info("Y", elem, None)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, OP_VERSION)]
    functions = [ContinuousSliceFFN.to_function_proto()] if with_function else []
    # IR 10 is read by every onnxruntime this project supports (>= 1.20).
    return helper.make_model(graph, opset_imports=opsets, ir_version=10, functions=functions)
