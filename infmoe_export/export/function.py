"""The ONNX local function `infmoe::ContinuousSliceFFN` (docs/reference/spec.md): the op in standard ops only.

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

`infmoe::QContinuousSliceFFN` (SPEC §6) is a second function that unpacks and scales both
expert matrices in one pass (stacked, so the dequantization is written once) and then calls
the first: its numbers are the float function's on w', and its invalid input gives NaN too
(bits, block_size, storage and scale shapes), except w_in's and w_out's storage or scales of
different widths, which cannot be stacked: onnxruntime fails there, as for unbroadcastable shapes.

`infmoe::QMatMul` (the onnxruntime target's quantized attention and LM head, docs/guide/quantization.md)
has onnxruntime's own MatMulNBits as its body: same inputs, attributes and storage, so an
onnxruntime without our kernel runs exactly the node it would have run without the op.
`infmoe::DecoderAttention` (the onnxruntime target's attention, docs/reference/ops/DecoderAttention.md) has
GroupQueryAttention as its body in the same way (a float16 KV cache's model: with the cache cast
to float32 around it), and `infmoe::WindowStarts` (its router and window starts in one node) the
ten standard ops the target wrote before.

`com.microsoft::MoE` and `QMoE` (onnxruntime's own expert ops, a conventional MoE's experts:
export/moe.py) get a function of the same domain and name: onnxruntime runs its kernel, which
claims the node; a runtime without the op runs the function. Its numbers are the CPU kernel's
(onnxruntime 1.32): softmax over all E router logits, the top k in the order (-logit, -index), so
of equal logits the highest index wins (the export stores the experts reversed, which keeps the
reference's lowest-index rule), with normalize_routing_weights = 1 the k weights divided by their
sum, and every expert evaluated densely (each token through all E experts, weighted by a gate
that is zero off its top k). It implements activation_type "gelu" (onnxruntime's CPU gelu is the
tanh form) and normalize_routing_weights 0 or 1; any other value gives NaN, like a bad
expert_weight_bits or block_size of QMoE. QMoE's function dequantizes the weights first (SPEC §6's storage,
which is QMoE's, per expert row, by `infmoe::DequantizeRows`) and always divides the k weights by
their sum, as its kernel does without the optional router_weights input (the export writes
neither that input nor zero points).
"""

import math
from typing import Optional

import onnx_ir as ir
from onnx import TensorProto, helper
from onnxscript import script, values
from onnxscript import opset18 as op

from ..contract import DOMAIN, MS_DOMAIN, OP_TYPE, OP_VERSION
from ..model import GELU_TANH_C, GELU_TANH_CUBIC
from ..quant import DEFAULT_BLOCK_SIZE, Q_OP_TYPE, QMATMUL_OP_TYPE

ATTENTION_OP_TYPE, ROUTER_OP_TYPE, STEP_OP_TYPE = "DecoderAttention", "WindowStarts", "StepInputs"
NORM_OP_TYPE = "SkipLayerNorm"

infmoe = values.Opset(DOMAIN, OP_VERSION)
contrib = values.Opset(MS_DOMAIN, 1)

_NAN = math.nan
_INT64_MAX = 2 ** 63 - 1
_INT64_MIN = -2 ** 63
_FLOAT32_LOWEST = -3.4028234663852886e38  # float32's lowest: the additive mask of a pad


@script(infmoe, default_opset=op)
def ContinuousSliceFFN(X, starts, w_in, b_in, w_out, b_out, slice_width: int, activation: str = "gelu_tanh",
                       plugin_namespace: str = "infmoe", plugin_version: str = "1"):
    # plugin_namespace and plugin_version only identify the op (TensorRT plugin lookup).
    H = op.Shape(w_in, start=0, end=1)                                            # [1]
    D = op.Shape(X, start=-1)                                                     # [1]
    r = op.Constant(value_int=slice_width)

    # Validation of the whole call (docs/reference/spec.md §6.1), one boolean. Shapes: the ranks
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


@script(infmoe, default_opset=op)
def QContinuousSliceFFN(X, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width: int,
                        bits: int, block_size: int, activation: str = "gelu_tanh", plugin_namespace: str = "infmoe",
                        plugin_version: str = "1"):
    H = op.Shape(w_in_q, start=0, end=1)                                          # [1]
    D = op.Shape(X, start=-1)                                                     # [1]
    n_bits = op.Constant(value_int=bits)
    B = op.Constant(value_int=block_size)
    # A bad bits or block size gives NaN; the safe values only keep the ops below well defined.
    bits_ok = op.Or(op.Equal(n_bits, 4), op.Equal(n_bits, 8))
    block_ok = op.And(op.GreaterOrEqual(B, 16), op.Equal(op.BitwiseAnd(B, B - 1), 0))
    safe_bits = op.Where(bits_ok, n_bits, 8)
    safe_B = op.Where(block_ok, B, 16)
    per_byte = 8 / safe_bits                                                      # values per byte: 1 or 2
    columns = (D + per_byte - 1) / per_byte
    blocks = (D + safe_B - 1) / safe_B
    # Storage shapes (SPEC §6), compared as in ContinuousSliceFFN.
    actual = op.Concat(op.Shape(op.Shape(w_in_q)), op.Shape(op.Shape(w_out_q)), op.Shape(op.Shape(w_in_scale)),
                       op.Shape(op.Shape(w_out_scale)), op.Shape(w_in_q), op.Shape(w_out_q), op.Shape(w_in_scale),
                       op.Shape(w_out_scale), axis=0)
    expected = op.Concat(op.Constant(value_ints=[2, 2, 2, 2]), H, columns, H, columns, H, blocks, H, blocks, axis=0)
    mismatch = op.Abs(op.Size(actual) - op.Size(expected)) + op.ReduceSum(
        op.Abs(op.Concat(actual, expected, axis=0) - op.Concat(expected, actual, axis=0)), keepdims=0)
    call_bad = op.Or(op.Or(op.Not(bits_ok), op.Not(block_ok)), op.Greater(mismatch, 0))
    penalty = op.Where(call_bad, op.CastLike(_NAN, X), op.CastLike(0.0, X))

    # Both matrices at once, [2H, columns]: value j of a byte is (byte >> j * bits) & (2^bits - 1),
    # so the low nibble is the even column; int8 is the same with one value per byte.
    packed = op.Concat(w_in_q, w_out_q, axis=0)
    shifts = op.Cast(op.Range(0, 8, safe_bits), to=TensorProto.UINT8)             # [0] or [0, 4]
    mask = op.Cast(op.Pow(2.0, op.Cast(safe_bits, to=TensorProto.FLOAT)) - 1.0, to=TensorProto.UINT8)
    values = op.BitwiseAnd(op.BitShift(op.Unsqueeze(packed, [-1]), shifts, direction="RIGHT"), mask)
    values = op.Reshape(values, op.Concat(op.Shape(packed, end=1), op.Constant(value_ints=[-1]), axis=0))
    # At least D columns (too few: zeros, already NaN above), then the pad nibble goes.
    short = op.Max(D - op.Shape(values, start=1), op.Constant(value_ints=[0]))
    values = op.Slice(op.Pad(values, op.Concat(op.Constant(value_ints=[0, 0, 0]), short, axis=0)), [0], D, [1])
    offset = op.CastLike(op.Pow(2.0, op.Cast(safe_bits - 1, to=TensorProto.FLOAT)), X)  # float32: CPU has no fp16 Pow
    # Column j's scale is scale[:, j div B] (clamped, so a short scale is NaN above, not an error).
    column = op.Range(0, op.Squeeze(D, [0]), 1) / safe_B
    column = op.Min(column, op.Squeeze(op.Shape(w_in_scale, start=1, end=2), [0]) - 1)
    scales = op.Gather(op.Concat(w_in_scale, w_out_scale, axis=0), column, axis=1)  # [2H, D]
    w = (op.CastLike(values, X) - offset) * scales                                  # w' = q * scale
    w_in = op.Slice(w, [0], H, [0])
    w_out = op.Slice(w, H, H + H, [0])
    Y = ContinuousSliceFFN(X, starts, w_in, b_in, w_out, b_out, slice_width=slice_width, activation=activation)
    return Y + penalty


@script(infmoe, default_opset=op)
def QMatMul(A, B, scales, K: int, N: int, bits: int, block_size: int):
    return contrib.MatMulNBits(A, B, scales, K=K, N=N, bits=bits, block_size=block_size)


@script(infmoe, default_opset=op)
def DecoderAttention(qkv, past_key, past_value, seqlens_k, total_sequence_length, attention_bias, qkv_bias,
                     num_heads: int):
    # GroupQueryAttention's inputs 1, 2 (separate key and value) and 7-9 (rotary) stay empty; it
    # has no bias input, so qkv_bias (optional to the kernel, given by every export) is an Add here.
    y, present_key, present_value = contrib.GroupQueryAttention(
        op.Add(qkv, qkv_bias), None, None, past_key, past_value, seqlens_k, total_sequence_length, None, None, None,
        attention_bias, num_heads=num_heads, kv_num_heads=num_heads)
    return y, present_key, present_value


@script(infmoe, default_opset=op)
def DecoderAttentionFloat16Cache(qkv, past_key, past_value, seqlens_k, total_sequence_length, attention_bias, qkv_bias,
                                 num_heads: int):
    # The body of DecoderAttention in a model with a float16 KV cache (written under that name,
    # function_protos). GroupQueryAttention takes one type for all of them, so the cache is read
    # as float32 and the presents are written back in the past's type; the new keys and values
    # are rounded to float16 first, as the kernel writes them before its queries read them. A
    # float32 cache keeps the body above: there onnxruntime drops the first Cast but keeps the
    # second (it makes a graph output), so a past and present bound to one buffer would be a copy
    # of the whole cache.
    biased = op.Add(qkv, qkv_bias)
    third = op.Div(op.Shape(biased, start=2), op.Constant(value_ints=[3]))
    query, key_value = op.Split(biased, op.Concat(third, op.Mul(third, op.Constant(value_ints=[2])), axis=0), axis=2)
    rounded = op.Cast(op.Cast(key_value, to=TensorProto.FLOAT16), to=TensorProto.FLOAT)
    y, present_key, present_value = contrib.GroupQueryAttention(
        op.Concat(query, rounded, axis=2), None, None, op.Cast(past_key, to=TensorProto.FLOAT),
        op.Cast(past_value, to=TensorProto.FLOAT), seqlens_k, total_sequence_length, None, None, None,
        attention_bias, num_heads=num_heads, kv_num_heads=num_heads)
    return y, op.CastLike(present_key, past_key), op.CastLike(present_value, past_value)


@script(infmoe, default_opset=op)
def WindowStarts(X, weight, bias, eps, ffn_hidden: int, slice_width: int):
    # SPEC §3: z = mu + softplus(s) eps with [mu, s] = X weight + bias, starts = floor(sigmoid(z)
    # (H - r + 1)) clamped at H - r; the floor left to Cast (truncation of a value >= 0).
    mu, sigma = op.Split(op.Add(op.MatMul(X, weight), bias), num_outputs=2, axis=-1)
    z = op.Add(mu, op.Mul(op.Softplus(sigma), eps))
    last = op.Cast(op.Sub(op.Constant(value_int=ffn_hidden), op.Constant(value_int=slice_width)), to=TensorProto.FLOAT)
    return op.Cast(op.Clip(op.Mul(op.Sigmoid(z), op.Add(last, 1.0)), None, last), to=TensorProto.INT64)


@script(infmoe, default_opset=op)
def SkipLayerNorm(input, skip, gamma, beta, bias, epsilon: float):
    # onnxruntime's own node, as the target wrote it before (bias may be absent: so it is there).
    output, _mean, _inv_std, total = contrib.SkipLayerNormalization(input, skip, gamma, beta, bias, epsilon=epsilon)
    return output, total


@script(infmoe, default_opset=op)
def StepInputs(input_ids, attention_mask):
    # Positions count real tokens only (model.py): the exclusive cumsum of the mask (cumsum - 1
    # clamped at 0 wherever a token is real or a left pad), its last `sequence` columns.
    counts = op.CumSum(attention_mask, op.Constant(value_int=1), exclusive=1)
    sequence = op.Shape(input_ids, start=1)
    position_ids = op.Slice(counts, op.Neg(sequence), op.Constant(value_ints=[_INT64_MAX]), op.Constant(value_ints=[1]))
    # Every row holds `total` positions in the cache (pads too, masked by the bias): seqlens_k =
    # total - 1, the last index of the largest of the (non-decreasing) counts.
    seqlens_k = op.Cast(op.ArgMax(counts, axis=1, keepdims=0, select_last_index=1), to=TensorProto.INT32)
    total_sequence_length = op.Cast(op.Shape(attention_mask, start=1), to=TensorProto.INT32)
    bias = op.Where(op.Cast(attention_mask, to=TensorProto.BOOL), op.Constant(value_float=0.0),
                    op.Constant(value_float=_FLOAT32_LOWEST))
    # [batch, 1, 1, total] broadcast with [sequence, 1]: [batch, 1, sequence, total]
    attention_bias = op.Expand(op.Unsqueeze(bias, op.Constant(value_ints=[1, 2])),
                               op.Concat(sequence, op.Constant(value_ints=[1]), axis=0))
    return position_ids, seqlens_k, total_sequence_length, attention_bias


@script(contrib, default_opset=op)
def MoE(input, router_probs, fc1_experts_weights, fc1_experts_bias, fc2_experts_weights, fc2_experts_bias, k: int,
        activation_type: str = "relu", normalize_routing_weights: int = 0):
    D = op.Shape(input, start=-1)
    E = op.Shape(fc1_experts_weights, start=0, end=1)
    x = op.Reshape(input, op.Concat(op.Constant(value_ints=[-1]), D, axis=0))    # [N, D]
    logits = op.Reshape(router_probs, op.Concat(op.Constant(value_ints=[-1]), E, axis=0))  # [N, E]
    # The activation, compared as ContinuousSliceFFN compares its own; normalize 0 or 1.
    known = op.TfIdfVectorizer(op.Reshape(op.Constant(value_string=activation_type), [1]), max_gram_length=1,
                               min_gram_length=1, max_skip_count=0, mode="TF", ngram_counts=[0], ngram_indexes=[0],
                               pool_strings=["gelu"])
    normalize = op.Constant(value_int=normalize_routing_weights)
    call_bad = op.Or(op.Less(op.ReduceSum(known, keepdims=0), 1.0),
                     op.Not(op.Or(op.Equal(normalize, 0), op.Equal(normalize, 1))))
    penalty = op.Where(call_bad, op.CastLike(_NAN, input), op.CastLike(0.0, input))

    # The top k, equal logits to the highest index: TopK gives them to the lowest, so it runs on
    # the logits reversed, and index j there is expert E - 1 - j.
    reversed_logits = op.Slice(logits, [-1], op.Constant(value_ints=[_INT64_MIN]), [1], [-1])
    _, picked = op.TopK(reversed_logits, op.Reshape(op.Constant(value_int=k), [1]), axis=1, largest=1, sorted=1)
    experts = op.Sub(E - 1, picked)                                               # [N, k]
    probabilities = op.Softmax(logits, axis=1)
    weights = op.GatherElements(probabilities, experts, axis=1)
    weights = op.Where(op.Equal(normalize, 1), weights / op.ReduceSum(weights, [1], keepdims=1), weights)
    gate = op.ScatterElements(op.Mul(probabilities, op.CastLike(0.0, probabilities)), experts, weights, axis=1)

    # Every expert on every token: [N, E I] -> [E, N, I] -> [E, N, D], summed under the gate.
    a = op.MatMul(x, op.Transpose(op.Reshape(fc1_experts_weights, op.Concat(op.Constant(value_ints=[-1]), D, axis=0)),
                                  perm=[1, 0])) + op.Reshape(fc1_experts_bias, [-1])
    c = op.CastLike(GELU_TANH_C, x)
    cubic = op.CastLike(GELU_TANH_CUBIC, x)
    gelu = op.CastLike(0.5, x) * a * (op.CastLike(1.0, x) + op.Tanh(c * (a + cubic * a * a * a)))
    hidden = op.Transpose(op.Reshape(gelu, op.Concat(op.Constant(value_ints=[-1]), E,
                                                     op.Shape(fc1_experts_weights, start=1, end=2), axis=0)),
                          perm=[1, 0, 2])
    outputs = op.MatMul(hidden, op.Transpose(fc2_experts_weights, perm=[0, 2, 1])) + op.Unsqueeze(fc2_experts_bias, [1])
    y = op.ReduceSum(outputs * op.Unsqueeze(op.Transpose(gate, perm=[1, 0]), [-1]), [0], keepdims=0)
    return op.Reshape(y, op.Shape(input)) + penalty


@script(infmoe, default_opset=op)
def DequantizeRows(packed, scales, columns, bits, block_size):
    # packed [..., N, bytes] uint8 (SPEC §6's storage: offset 2^(bits - 1), two columns a byte at
    # 4 bits, the even one in the low nibble), scales [..., N, blocks]: w' [..., N, columns] in
    # the scales' type. columns is a [1], bits and block_size scalars, all int64 (inputs, so that
    # QMoE can pass safe values for bad attributes).
    shifts = op.Cast(op.Range(0, 8, bits), to=TensorProto.UINT8)                  # [0] or [0, 4]
    mask = op.Cast(op.Pow(2.0, op.Cast(bits, to=TensorProto.FLOAT)) - 1.0, to=TensorProto.UINT8)
    values = op.BitwiseAnd(op.BitShift(op.Unsqueeze(packed, [-1]), shifts, direction="RIGHT"), mask)
    values = op.Reshape(values, op.Concat(op.Shape(packed, end=-1), op.Constant(value_ints=[-1]), axis=0))
    values = op.Slice(values, [0], columns, [-1])
    offset = op.Pow(2.0, op.Cast(bits - 1, to=TensorProto.FLOAT))
    scale = op.Gather(scales, op.Range(0, op.Squeeze(columns, [0]), 1) / block_size, axis=-1)
    return op.CastLike(op.Cast(values, to=TensorProto.FLOAT) - offset, scales) * scale


@script(contrib, default_opset=op)
def QMoE(input, router_probs, fc1_experts_weights, fc1_scales, fc1_experts_bias, fc2_experts_weights, fc2_scales,
         fc2_experts_bias, k: int, activation_type: str = "relu", normalize_routing_weights: int = 0,
         expert_weight_bits: int = 4, block_size: int = 0):
    n_bits = op.Constant(value_int=expert_weight_bits)
    B = op.Constant(value_int=block_size)
    # A bad bits or block size gives NaN; the safe values only keep the ops below well defined.
    bits_ok = op.Or(op.Equal(n_bits, 4), op.Equal(n_bits, 8))
    block_ok = op.And(op.GreaterOrEqual(B, 16), op.Equal(op.BitwiseAnd(B, B - 1), 0))
    penalty = op.Where(op.And(bits_ok, block_ok), op.CastLike(0.0, input), op.CastLike(_NAN, input))
    safe_bits = op.Where(bits_ok, n_bits, 8)
    safe_B = op.Where(block_ok, B, 16)
    fc1 = DequantizeRows(fc1_experts_weights, fc1_scales, op.Shape(input, start=-1), safe_bits, safe_B)
    fc2 = DequantizeRows(fc2_experts_weights, fc2_scales, op.Shape(fc1_experts_weights, start=1, end=2), safe_bits,
                         safe_B)
    # normalize_routing_weights is not read: the kernel normalizes either way (module doc).
    Y = MoE(input, router_probs, fc1, fc1_experts_bias, fc2, fc2_experts_bias, k=k, activation_type=activation_type,
            normalize_routing_weights=1)
    return Y + penalty


FUNCTIONS = {OP_TYPE: (ContinuousSliceFFN,), Q_OP_TYPE: (ContinuousSliceFFN, QContinuousSliceFFN),
             QMATMUL_OP_TYPE: (QMatMul,), ATTENTION_OP_TYPE: (DecoderAttention,), ROUTER_OP_TYPE: (WindowStarts,),
             STEP_OP_TYPE: (StepInputs,), NORM_OP_TYPE: (SkipLayerNorm,)}
# onnxruntime's own ops a conventional MoE's export writes, by op type (com.microsoft domain):
# their fallback functions (QMoE's dequantizes with an infmoe-domain helper, then calls MoE's).
MOE_FUNCTIONS = {"MoE": (MoE,), "QMoE": (MoE, DequantizeRows, QMoE)}


def function_protos(op_type: str, kv_cache: str = "float32") -> list:
    """The FunctionProtos a node of op_type needs (FUNCTIONS, MOE_FUNCTIONS); the attention's over
    a float16 KV cache (contract.KV_CACHES) is DecoderAttentionFloat16Cache, named DecoderAttention."""
    if op_type == ATTENTION_OP_TYPE and kv_cache == "float16":
        proto = DecoderAttentionFloat16Cache.to_function_proto()
        proto.name = ATTENTION_OP_TYPE
        return [proto]
    return [f.to_function_proto() for f in {**FUNCTIONS, **MOE_FUNCTIONS}[op_type]]


def ir_functions(opset: int, op_types=(OP_TYPE,), kv_cache: str = "float32") -> list:
    """The functions a model of this opset needs for its op_types (the infmoe ops, and
    onnxruntime's MoE / QMoE; a quantized expert op calls the float one) and KV cache type
    (function_protos), as onnx_ir Functions (the checker wants a function's default opset to match
    the model's; every op here means the same from 18 on, later opsets only add types)."""
    needed = {}
    for op_type in sorted(op_types):
        needed.update({proto.name: proto for proto in function_protos(op_type, kv_cache)})
    functions = [ir.serde.deserialize_function(proto) for proto in needed.values()]
    for function in functions:
        function.opset_imports[""] = opset
    return functions


def _one_node_model(node, inputs, outputs, with_function: bool, kv_cache: str = "float32"):
    """A model of one infmoe node (named after its op type); with_function attaches the op's
    fallback functions (function_protos) and imports the other domains their bodies use (com.microsoft).
    IR 10 is read by every onnxruntime this project supports (>= 1.20)."""
    graph = helper.make_graph([node], node.op_type, inputs, outputs)
    functions = function_protos(node.op_type, kv_cache) if with_function else []
    opsets = {"": 18, DOMAIN: OP_VERSION}
    for function in functions:
        for imported in function.opset_import:
            opsets.setdefault(imported.domain, imported.version)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                             ir_version=10, functions=functions)


def op_model(slice_width: int, dtype: str = "float32", activation: str = "gelu_tanh", with_function: bool = False,
             bits: Optional[int] = None, block_size: int = DEFAULT_BLOCK_SIZE):
    """A one-node ONNX model of the op, every input of free shape (tests, fuzzing, benchmarks);
    with bits, of the quantized op (SPEC §6).

    with_function attaches the standard-op fallback function, which onnxruntime runs when the
    kernel library is not registered."""
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    op_type = OP_TYPE if bits is None else Q_OP_TYPE
    names = ["X", "starts", "w_in", "b_in", "w_out", "b_out"] if bits is None else \
        ["X", "starts", "w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out"]
    types = {"starts": TensorProto.INT64, "w_in_q": TensorProto.UINT8, "w_out_q": TensorProto.UINT8}
    inputs = [helper.make_tensor_value_info(n, types.get(n, elem), None) for n in names]
    quantized = {} if bits is None else dict(bits=bits, block_size=block_size)
    node = helper.make_node(op_type, names, ["Y"], domain=DOMAIN, slice_width=slice_width, activation=activation,
                            plugin_namespace=DOMAIN, plugin_version=str(OP_VERSION), **quantized)
    return _one_node_model(node, inputs, [helper.make_tensor_value_info("Y", elem, None)], with_function)


def qmatmul_model(k: int, n: int, bits: int, block_size: int, dtype: str = "float32", with_function: bool = False):
    """A one-node model of `infmoe::QMatMul` (inputs A, B, scales of free shape): tests, fuzzing,
    benchmarks; with_function attaches its fallback (MatMulNBits)."""
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    inputs = [helper.make_tensor_value_info("A", elem, None), helper.make_tensor_value_info("B", TensorProto.UINT8, None),
              helper.make_tensor_value_info("scales", elem, None)]
    node = helper.make_node(QMATMUL_OP_TYPE, ["A", "B", "scales"], ["Y"], domain=DOMAIN, K=k, N=n, bits=bits,
                            block_size=block_size)
    return _one_node_model(node, inputs, [helper.make_tensor_value_info("Y", elem, None)], with_function)


def attention_model(num_heads: int, with_function: bool = False, past: bool = True, qkv_bias: bool = True,
                    kv_cache: str = "float32"):
    """A one-node model of `infmoe::DecoderAttention` (every input of free shape; past, qkv_bias:
    with those optional inputs; kv_cache: past and present float32 or float16): tests, fuzzing,
    benchmarks; with_function attaches its fallback (an Add and GroupQueryAttention, and the casts
    of a float16 cache), which needs qkv_bias."""
    if with_function and not qkv_bias:
        raise ValueError("DecoderAttention's fallback function needs qkv_bias")
    cache = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[kv_cache]
    names = ["qkv", "past_key", "past_value", "seqlens_k", "total_sequence_length", "attention_bias", "qkv_bias"]
    types = {"seqlens_k": TensorProto.INT32, "total_sequence_length": TensorProto.INT32, "past_key": cache,
             "past_value": cache, "present_key": cache, "present_value": cache}
    used = [n for n in names if (past or not n.startswith("past")) and (qkv_bias or n != "qkv_bias")]
    inputs = [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None) for n in used]
    outputs = [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None)
               for n in ("y", "present_key", "present_value")]
    node = helper.make_node(ATTENTION_OP_TYPE, [n if n in used else "" for n in names], [o.name for o in outputs],
                            domain=DOMAIN, num_heads=num_heads)
    return _one_node_model(node, inputs, outputs, with_function, kv_cache)


def step_inputs_model(with_function: bool = False):
    """A one-node model of `infmoe::StepInputs` (input_ids and attention_mask int64 of free
    shape): tests; with_function attaches its fallback (the standard ops)."""
    names = ["input_ids", "attention_mask"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in names]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in (
        ("position_ids", TensorProto.INT64), ("seqlens_k", TensorProto.INT32),
        ("total_sequence_length", TensorProto.INT32), ("attention_bias", TensorProto.FLOAT))]
    node = helper.make_node(STEP_OP_TYPE, names, [o.name for o in outputs], domain=DOMAIN)
    return _one_node_model(node, inputs, outputs, with_function)


def skip_layer_norm_model(epsilon: float, bias: bool = True, with_function: bool = False):
    """A one-node model of `infmoe::SkipLayerNorm` (inputs input, skip, gamma, beta and, with bias,
    bias, of free shape; outputs output and input_skip_bias_sum): tests, fuzzing; with_function
    attaches its fallback (onnxruntime's SkipLayerNormalization)."""
    names = ["input", "skip", "gamma", "beta"] + (["bias"] if bias else [])
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("output", "input_skip_bias_sum")]
    node = helper.make_node(NORM_OP_TYPE, names, [o.name for o in outputs], domain=DOMAIN, epsilon=epsilon)
    return _one_node_model(node, inputs, outputs, with_function)


def moe_op_model(k: int, normalize_routing_weights: int, bits: Optional[int] = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, with_function: bool = False):
    """A one-node model of onnxruntime's com.microsoft MoE (bits None) or QMoE with the
    attributes a conventional-MoE export writes (export/moe.py), every input of free shape:
    tests; with_function attaches its fallback function."""
    from .moe import FLOAT_INPUTS, QUANTIZED_INPUTS, moe_attributes

    names = ["input", "router_probs", *(FLOAT_INPUTS if bits is None else QUANTIZED_INPUTS)]
    inputs = [helper.make_tensor_value_info(n, TensorProto.UINT8 if n.endswith("_experts_weights") and bits
                                            else TensorProto.FLOAT, None) for n in names]
    op_type = "MoE" if bits is None else "QMoE"
    node = helper.make_node(op_type, names, ["output"], domain=MS_DOMAIN,
                            **moe_attributes(k, normalize_routing_weights, bits, block_size))
    graph = helper.make_graph([node], op_type, inputs, [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)])
    functions = [f.to_function_proto() for f in MOE_FUNCTIONS[op_type]] if with_function else []
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(MS_DOMAIN, 1)] + \
        ([helper.make_opsetid(DOMAIN, OP_VERSION)] if with_function and bits else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10, functions=functions)


def window_starts_model(ffn_hidden: int, slice_width: int, with_function: bool = False):
    """A one-node model of `infmoe::WindowStarts` (inputs X, weight, bias, eps of free shape):
    tests, fuzzing; with_function attaches its fallback (the standard ops)."""
    names = ["X", "weight", "bias", "eps"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names]
    node = helper.make_node(ROUTER_OP_TYPE, names, ["starts"], domain=DOMAIN, ffn_hidden=ffn_hidden,
                            slice_width=slice_width)
    return _one_node_model(node, inputs, [helper.make_tensor_value_info("starts", TensorProto.INT64, None)],
                           with_function)
