"""The ONNX local function `infmoe::ContinuousSliceFFN` (docs/spec.md): the op in standard ops only.

Every exported model carries it, so a runtime without the compiled kernel still runs the model.
It is the reference's dense form: all H hidden units, each weighted by its coverage c_i. GELU is
written out (tanh form, constants from model.py) because ONNX has Gelu only from opset 20 and the
exporter supports 18 and up.

A graph cannot raise, so the function follows the spec's verdict for graph-only implementations:
the output rows of a token with a start outside [0, H - r] are NaN, and so is every row when a
rule about the whole call is broken (shapes that broadcast instead of failing, K = 0,
slice_width outside [1, H], an unknown activation). Mismatched shapes that no op can broadcast
make onnxruntime itself fail. For valid input the NaN term is an exact + 0: the numbers are the
dense form's, bit for bit.
"""

import math

import onnx_ir as ir
from onnx import TensorProto, helper
from onnxscript import script, values
from onnxscript import opset18 as op

from ..contract import DOMAIN, OP_TYPE, OP_VERSION
from ..model import GELU_TANH_C, GELU_TANH_CUBIC

infmoe = values.Opset(DOMAIN, OP_VERSION)

_NAN = math.nan


@script(infmoe, default_opset=op)
def ContinuousSliceFFN(X, starts, w_in, b_in, w_out, b_out, slice_width: int, activation: str = "gelu_tanh",
                       plugin_namespace: str = "infmoe", plugin_version: str = "1"):
    # plugin_namespace and plugin_version only identify the op (TensorRT plugin lookup).
    H = op.Shape(w_in, start=0, end=1)                                            # [1]
    D = op.Shape(X, start=-1)                                                     # [1]
    r = op.Constant(value_int=slice_width)

    # Validation of the whole call (docs/spec.md §6.1), one boolean. Shapes: the ranks
    # and the dims of starts[:-1], w_in, b_in, w_out, b_out against those X and w_in imply;
    # two int vectors a, b are equal iff |len a - len b| + sum |(a ++ b) - (b ++ a)| = 0.
    lead = op.Shape(X, end=-1)
    actual = op.Concat(op.Shape(op.Shape(starts, end=-1)), op.Shape(op.Shape(w_in)), op.Shape(op.Shape(b_in)),
                       op.Shape(op.Shape(w_out)), op.Shape(op.Shape(b_out)),
                       op.Shape(starts, end=-1), op.Shape(w_in), op.Shape(b_in), op.Shape(w_out), op.Shape(b_out),
                       axis=0)
    expected = op.Concat(op.Shape(lead), op.Constant(value_ints=[2, 1, 2, 1]),
                         lead, H, D, H, H, D, D, axis=0)
    mismatch = op.Abs(op.Size(actual) - op.Size(expected)) + op.ReduceSum(
        op.Abs(op.Concat(actual, expected, axis=0) - op.Concat(expected, actual, axis=0)), keepdims=0)
    # The activation: a string attribute can only be compared by a string op in opset 18;
    # TfIdfVectorizer counts the occurrences of "gelu_tanh" in [activation]: 1 iff equal.
    known = op.TfIdfVectorizer(op.Reshape(op.Constant(value_string=activation), [1]), max_gram_length=1,
                               min_gram_length=1, max_skip_count=0, mode="TF", ngram_counts=[0],
                               ngram_indexes=[0], pool_strings=["gelu_tanh"])
    H0 = op.ReduceSum(H, keepdims=0)
    K = op.ReduceSum(op.Shape(starts, start=-1), keepdims=0)
    call_bad = op.Or(op.Or(op.Greater(mismatch, 0), op.Less(op.ReduceSum(known, keepdims=0), 1.0)),
                     op.Or(op.Or(op.Less(r, 1), op.Greater(r, H0)), op.Less(K, 1)))
    # Per token: any start outside [0, H - r] (compared as int64, so INT64 extremes too).
    outside = op.Or(op.Less(starts, 0), op.Greater(starts, H0 - r))             # [..., K]
    token_bad = op.Greater(op.ReduceSum(op.Cast(outside, to=TensorProto.INT64), [-1], keepdims=1), 0)
    penalty = op.Where(op.Or(token_bad, call_bad), op.CastLike(_NAN, X), op.CastLike(0.0, X))  # [..., 1]

    # Coverage, per-unit count form: unit i is inside window k iff s_k <= i < s_k + r; the mean
    # over the K windows of that 0/1 indicator is n_i / K, the definition (exact sum, one divide).
    units = op.Range(0, op.Squeeze(H, [0]), 1)                                    # [H]
    s = op.Unsqueeze(starts, [-1])                                                # [..., K, 1]
    inside = op.And(op.GreaterOrEqual(units, s), op.Less(units, s + slice_width))  # [..., K, H]
    weight = op.ReduceMean(op.CastLike(inside, X), [-2], keepdims=0)              # [..., H]

    a = op.MatMul(X, op.Transpose(w_in, perm=[1, 0])) + b_in
    c = op.CastLike(GELU_TANH_C, X)
    cubic = op.CastLike(GELU_TANH_CUBIC, X)
    gelu = op.CastLike(0.5, X) * a * (op.CastLike(1.0, X) + op.Tanh(c * (a + cubic * a * a * a)))
    Y = op.MatMul(gelu * weight, w_out) + b_out + penalty
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
