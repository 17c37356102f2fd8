"""The plugins' shape, type and attribute rules (SPEC §4 and §6) as plain functions, testable
without TensorRT.

plugin.py turns TensorRT's tensor descriptors into ranks, dtype names and static shapes and
calls these; every rule broken raises InfMoEError naming the input and what to change. Each
function takes the op (FLOAT_OP, the default, or Q_OP); the rules are the same where the ops
agree.
"""

from typing import Dict, NamedTuple, Optional, Sequence, Tuple

from ....errors import InfMoEError
from ....model import ACTIVATIONS
from ....quant import Q_OP_TYPE, check_bits, check_block_size, n_blocks, packed_columns

FLOAT_TYPES = ("float32", "float16")
# TensorRT has no uint8 constants, so network.plugin_model retypes the packed uint8 weights to
# int8 (same bytes) and the plugin takes them as int8.
PACKED_TYPE = "int8"


class Op(NamedTuple):
    plugin_id: str
    inputs: Tuple[str, ...]
    weight_ranks: Dict[str, int]  # X and starts have the same rank, at least 1
    packed: Tuple[str, ...] = ()  # the integer storage inputs (PACKED_TYPE); the other weights are like X


FLOAT_OP = Op("infmoe::ContinuousSliceFFN", ("X", "starts", "w_in", "b_in", "w_out", "b_out"),
              {"w_in": 2, "b_in": 1, "w_out": 2, "b_out": 1})
Q_OP = Op(f"infmoe::{Q_OP_TYPE}", ("X", "starts", "w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out"),
          {"w_in_q": 2, "w_in_scale": 2, "b_in": 1, "w_out_q": 2, "w_out_scale": 2, "b_out": 1},
          ("w_in_q", "w_out_q"))


def attribute_text(value: str) -> str:
    """A string attribute as the model wrote it. TensorRT's ONNX parser copies a string
    attribute as a C string whose length counts the terminating NUL, and tensorrt.plugin
    decodes every byte of it, so "gelu_tanh" arrives as "gelu_tanh\\x00"."""
    return value.rstrip("\x00")


def check_attributes(slice_width: int, activation: str, op: Op = FLOAT_OP) -> str:
    """Checks the attributes; returns the activation without the parser's trailing NUL."""
    if isinstance(slice_width, bool) or not isinstance(slice_width, int) or slice_width < 1:
        raise InfMoEError(f"{op.plugin_id}: slice_width must be a positive integer, got {slice_width!r}")
    name = attribute_text(activation)
    if name not in ACTIVATIONS:
        raise InfMoEError(f"{op.plugin_id}: unknown activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return name


def check_q_attributes(slice_width: int, activation: str, bits: int, block_size: int) -> str:
    """QContinuousSliceFFN's attributes: the float op's, bits 4 or 8, block_size a power of two >= 16."""
    name = check_attributes(slice_width, activation, Q_OP)
    try:
        check_bits(bits), check_block_size(block_size)
    except InfMoEError as error:
        raise InfMoEError(f"{Q_OP.plugin_id}: {error}") from None
    return name


def check_ranks(ranks: Sequence[int], op: Op = FLOAT_OP) -> None:
    if len(ranks) != len(op.inputs):
        raise InfMoEError(f"{op.plugin_id}: expected {len(op.inputs)} inputs {op.inputs}, got {len(ranks)}")
    named = dict(zip(op.inputs, ranks))
    if named["X"] < 1:
        raise InfMoEError(f"{op.plugin_id}: X must have shape [..., D], got rank {named['X']}")
    if named["starts"] != named["X"]:
        raise InfMoEError(f"{op.plugin_id}: starts must have X's rank {named['X']} ([..., K]), got {named['starts']}")
    for name, rank in op.weight_ranks.items():
        if named[name] != rank:
            raise InfMoEError(f"{op.plugin_id}: {name} must have rank {rank}, got {named[name]}")


def output_dtype(dtypes: Sequence[str], op: Op = FLOAT_OP) -> str:
    """Y has X's dtype; X and the float weights share one float type, starts is int64, the
    packed weights PACKED_TYPE."""
    named = dict(zip(op.inputs, dtypes))
    if named["X"] not in FLOAT_TYPES:
        raise InfMoEError(f"{op.plugin_id}: X must be float32 or float16, got {named['X']}")
    if named["starts"] != "int64":
        raise InfMoEError(f"{op.plugin_id}: starts must be int64, got {named['starts']}")
    for name in op.weight_ranks:
        if name in op.packed:
            if named[name] != PACKED_TYPE:
                raise InfMoEError(f"{op.plugin_id}: {name} must be {PACKED_TYPE} (the uint8 storage retyped by "
                                  f"`infmoe-export trt`), got {named[name]}")
        elif named[name] != named["X"]:
            raise InfMoEError(f"{op.plugin_id}: {name} must have X's dtype {named['X']}, got {named[name]}")
    return named["X"]


def specialisation(shapes: Sequence[Sequence[Optional[int]]], slice_width: int, bits: Optional[int] = None,
                   block_size: Optional[int] = None) -> dict:
    """The kernel's compile-time constants: H, D, r and K from the inputs' static dims (bits None:
    ContinuousSliceFFN; else QContinuousSliceFFN with bits and block_size, already checked).

    shapes holds each input's dims, None where the dim is only known at run time. H and D come
    from the weights (build-time constants; for the packed op D is X's last dim, which int4's
    packing leaves ambiguous otherwise), K from starts' last dim, which `infmoe-export trt` pins
    to the model's K before TensorRT parses it (network.pin_expert_budget).
    """
    op = FLOAT_OP if bits is None else Q_OP
    named = dict(zip(op.inputs, shapes))
    H = named[op.inputs[2]][0]  # w_in or w_in_q: one row per hidden unit
    D = named["w_in"][1] if bits is None else named["X"][-1]
    if bits == 8 and D is None:  # int8 stores one byte per weight
        D = named["w_in_q"][1]
    K = named["starts"][-1]
    d_label = "D (w_in dim 1)" if bits is None else "D (X's last dim)"
    for label, value in ((f"H ({op.inputs[2]} dim 0)", H), (d_label, D)):
        if value is None:
            raise InfMoEError(f"{op.plugin_id}: {label} must be static to compile the kernel ahead of time: "
                              "keep the FFN weights as initializers in the ONNX model")
    if K is None:
        raise InfMoEError(f"{op.plugin_id}: K (starts' last dim) must be static to compile the kernel ahead of time: "
                          "build with `infmoe-export trt`, which pins it, or reshape starts to [..., K] in the model")
    if bits is None:
        expected = {"b_in": [H], "w_out": [H, D], "b_out": [D]}
    else:
        packed, blocks = [H, packed_columns(D, bits)], [H, n_blocks(D, block_size)]
        expected = {"w_in_q": packed, "w_in_scale": blocks, "b_in": [H], "w_out_q": packed, "w_out_scale": blocks,
                    "b_out": [D]}
    for name, shape in expected.items():
        if any(dim is not None and dim != want for dim, want in zip(named[name], shape)):
            detail = "" if bits is None else f" for D {D}, {bits} bits and block size {block_size}"
            raise InfMoEError(f"{op.plugin_id}: {name} must have shape {shape}{detail}, got {list(named[name])}")
    if named["X"][-1] not in (None, D):
        raise InfMoEError(f"{op.plugin_id}: X's last dim must be D = {D}, got {named['X'][-1]}")
    if not 1 <= slice_width <= H:
        raise InfMoEError(f"{op.plugin_id}: slice_width must be in [1, H = {H}], got {slice_width}")
    if K < 1:
        raise InfMoEError(f"{op.plugin_id}: starts must hold K >= 1 windows per token, got K = {K}")
    return {"H": H, "D": D, "R": slice_width, "K": K}
