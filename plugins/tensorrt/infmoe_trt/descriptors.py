"""The plugin's shape, type and attribute rules (SPEC §4) as plain functions, testable without
TensorRT.

plugin.py turns TensorRT's tensor descriptors into ranks, dtype names and static shapes and
calls these; every rule broken raises InfMoEError naming the input and what to change.
"""

from typing import Optional, Sequence

from infmoe_export.errors import InfMoEError
from infmoe_export.model import ACTIVATIONS

PLUGIN_ID = "infmoe::ContinuousSliceFFN"
INPUTS = ("X", "starts", "w_in", "b_in", "w_out", "b_out")
FLOAT_TYPES = ("float32", "float16")
# Rank of each weight input; X and starts have the same rank, at least 1.
WEIGHT_RANKS = {"w_in": 2, "b_in": 1, "w_out": 2, "b_out": 1}


def attribute_text(value: str) -> str:
    """A string attribute as the model wrote it. TensorRT's ONNX parser copies a string
    attribute as a C string whose length counts the terminating NUL, and tensorrt.plugin
    decodes every byte of it, so "gelu_tanh" arrives as "gelu_tanh\\x00"."""
    return value.rstrip("\x00")


def check_attributes(slice_width: int, activation: str) -> str:
    """Checks the attributes; returns the activation without the parser's trailing NUL."""
    if isinstance(slice_width, bool) or not isinstance(slice_width, int) or slice_width < 1:
        raise InfMoEError(f"{PLUGIN_ID}: slice_width must be a positive integer, got {slice_width!r}")
    name = attribute_text(activation)
    if name not in ACTIVATIONS:
        raise InfMoEError(f"{PLUGIN_ID}: unknown activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return name


def check_ranks(ranks: Sequence[int]) -> None:
    if len(ranks) != len(INPUTS):
        raise InfMoEError(f"{PLUGIN_ID}: expected {len(INPUTS)} inputs {INPUTS}, got {len(ranks)}")
    named = dict(zip(INPUTS, ranks))
    if named["X"] < 1:
        raise InfMoEError(f"{PLUGIN_ID}: X must have shape [..., D], got rank {named['X']}")
    if named["starts"] != named["X"]:
        raise InfMoEError(f"{PLUGIN_ID}: starts must have X's rank {named['X']} ([..., K]), got {named['starts']}")
    for name, rank in WEIGHT_RANKS.items():
        if named[name] != rank:
            raise InfMoEError(f"{PLUGIN_ID}: {name} must have rank {rank}, got {named[name]}")


def output_dtype(dtypes: Sequence[str]) -> str:
    """Y has X's dtype; X and the weights share one float type, starts is int64."""
    named = dict(zip(INPUTS, dtypes))
    if named["X"] not in FLOAT_TYPES:
        raise InfMoEError(f"{PLUGIN_ID}: X must be float32 or float16, got {named['X']}")
    if named["starts"] != "int64":
        raise InfMoEError(f"{PLUGIN_ID}: starts must be int64, got {named['starts']}")
    for name in WEIGHT_RANKS:
        if named[name] != named["X"]:
            raise InfMoEError(f"{PLUGIN_ID}: {name} must have X's dtype {named['X']}, got {named[name]}")
    return named["X"]


def specialisation(shapes: Sequence[Sequence[Optional[int]]], slice_width: int) -> dict:
    """The kernel's compile-time constants: H, D, r and K from the inputs' static dims.

    shapes holds each input's dims, None where the dim is only known at run time. H and D come
    from the weights (build-time constants), K from starts' last dim, which `infmoe-export trt`
    pins to the model's K before TensorRT parses it (network.pin_expert_budget).
    """
    named = dict(zip(INPUTS, shapes))
    H, D = named["w_in"]
    K = named["starts"][-1]
    for label, value in (("H (w_in dim 0)", H), ("D (w_in dim 1)", D)):
        if value is None:
            raise InfMoEError(f"{PLUGIN_ID}: {label} must be static to compile the kernel ahead of time: "
                              "keep the FFN weights as initializers in the ONNX model")
    if K is None:
        raise InfMoEError(f"{PLUGIN_ID}: K (starts' last dim) must be static to compile the kernel ahead of time: "
                          "build with `infmoe-export trt`, which pins it, or reshape starts to [..., K] in the model")
    expected = {"b_in": [H], "w_out": [H, D], "b_out": [D]}
    for name, shape in expected.items():
        if any(dim is not None and dim != want for dim, want in zip(named[name], shape)):
            raise InfMoEError(f"{PLUGIN_ID}: {name} must have shape {shape}, got {list(named[name])}")
    if named["X"][-1] not in (None, D):
        raise InfMoEError(f"{PLUGIN_ID}: X's last dim must be D = {D}, got {named['X'][-1]}")
    if not 1 <= slice_width <= H:
        raise InfMoEError(f"{PLUGIN_ID}: slice_width must be in [1, H = {H}], got {slice_width}")
    if K < 1:
        raise InfMoEError(f"{PLUGIN_ID}: starts must hold K >= 1 windows per token, got K = {K}")
    return {"H": H, "D": D, "R": slice_width, "K": K}
