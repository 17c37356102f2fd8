"""QContinuousSliceFFN (SPEC §6) on the TensorRT path: the Triton kernel in Triton's CPU
interpreter against the level-1 reference (quant.q_continuous_slice_ffn: the float op on the
dequantized weights w'), the plugin's rules, the model the parser gets, engines per (K,
precision), and the AOT PTX for sm_90 through ptxas.

conftest.py sets TRITON_INTERPRET=1 before anything imports triton. Data is fresh every run
(normal weights scaled like a trained layer, never zero); the seed is printed in every failure
and INFMOE_TEST_SEED=<n> replays a run. Shapes are small: the interpreter runs every program in
Python.
"""

import inspect
import json
import os
import subprocess
import sys

import onnx
import pytest
import torch

from infmoe_export.contract import DecoderIO, ExportedModel
from infmoe_export.errors import InfMoEError
from infmoe_export.quant import QuantizedWeight, q_continuous_slice_ffn

pytest.importorskip("triton")
from infmoe_trt import descriptors, kernel  # noqa: E402

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
# |y - ref| <= tol * max|ref|: float32 as the float kernel (the same products on the same w');
# float16 Y is rounded once from a float32 sum, and the reference's w' is rounded to float16.
TOLERANCE = {torch.float32: 5e-6, torch.float16: 2e-3}


def make_starts(g, lead, H, r, K, windows):
    """starts [*lead, K]: random, or planted windows (first/last start, overlapping, disjoint)."""
    if windows == "random":
        return torch.randint(0, H - r + 1, (*lead, K), generator=g)
    if windows == "edges":  # starts 0 and H - r in every token
        return torch.tensor([0, H - r] * K)[:K].expand(*lead, K).clone()
    if windows == "overlap":  # every window shares rows with the next one
        base = torch.randint(0, H - r + 1 - (K - 1), (*lead, 1), generator=g)
        return base + torch.arange(K)
    assert windows == "disjoint" and K * r <= H
    return (torch.arange(K) * r).expand(*lead, K).clone()


def make_q_inputs(lead, H, D, r, K, bits, block_size, dtype=torch.float32, windows="random", seed=0):
    """Random inputs with quantized expert weights (weights never zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, generator=g)
    w_in = torch.randn(H, D, generator=g) / D ** 0.5
    w_out = torch.randn(H, D, generator=g) / r ** 0.5
    b_in, b_out = torch.randn(H, generator=g) * 0.5, torch.randn(D, generator=g)
    q_in, q_out = (QuantizedWeight.of(w, bits, block_size, scale_dtype=dtype) for w in (w_in, w_out))
    return (x.to(dtype), make_starts(g, lead, H, r, K, windows), q_in.packed, q_in.scale, b_in.to(dtype),
            q_out.packed, q_out.scale, b_out.to(dtype))


def assert_matches_reference(y, inputs, r, bits, block_size, what):
    ref = q_continuous_slice_ffn(*inputs, r, bits, block_size).double()
    error = (y.double() - ref).abs().max().item()
    bound = TOLERANCE[inputs[0].dtype] * ref.abs().max().item()
    assert error <= bound, f"{what}: max |y - ref| {error:.3g} > {bound:.3g} (INFMOE_TEST_SEED={SEED})"


# (lead, H, D, r, K, windows): H a prime, D not a multiple of the block (and odd: int4's pad
# nibble), r = 1 and r = H, K = 1 and K > 1, starts 0 and H - r, overlapping and disjoint windows.
SHAPES = {
    "k1-r1": ((3,), 37, 45, 1, 1, "random"),
    "k3-odd-d": ((2, 2), 37, 45, 7, 3, "random"),
    "r-equals-h": ((2,), 23, 33, 23, 2, "random"),
    "edges": ((2,), 41, 35, 9, 2, "edges"),
    "overlap": ((3,), 41, 35, 6, 4, "overlap"),
    "disjoint": ((2,), 29, 18, 7, 4, "disjoint"),
    "two-blocks-partial": ((1,), 19, 70, 5, 2, "random"),
}


@pytest.mark.parametrize("deterministic", [True, False], ids=["columns", "split"])
@pytest.mark.parametrize("bits, block_size", [(8, 32), (4, 16), (4, 64)], ids=["int8-b32", "int4-b16", "int4-b64"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_the_level1_reference(shape, bits, block_size, deterministic):
    lead, H, D, r, K, windows = SHAPES[shape]
    seed = SEED + hash((shape, bits, block_size)) % 1000
    inputs = make_q_inputs(lead, H, D, r, K, bits, block_size, windows=windows, seed=seed)
    y = kernel.q_continuous_slice_ffn_triton(*inputs, r, bits, block_size, deterministic=deterministic)
    assert y.shape == inputs[0].shape and y.dtype == torch.float32
    assert_matches_reference(y, inputs, r, bits, block_size, f"{shape} int{bits} B={block_size}")


@pytest.mark.parametrize("bits", [8, 4])
def test_float16_activations(bits):
    inputs = make_q_inputs((2, 3), 37, 45, 7, 3, bits, 32, dtype=torch.float16, seed=SEED + bits)
    y = kernel.q_continuous_slice_ffn_triton(*inputs, 7, bits, 32, deterministic=True)
    assert y.dtype == torch.float16
    assert_matches_reference(y, inputs, 7, bits, 32, f"float16 int{bits}")


def test_swapped_nibbles_are_caught():
    """A planted swap of the nibble order (odd column low) must not pass the reference check."""
    x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out = make_q_inputs(
        (2,), 23, 33, 5, 2, 4, 16, seed=SEED)
    swap = lambda packed: (packed >> 4) | (packed << 4)  # noqa: E731 -- uint8 shifts drop the other nibble
    y = kernel.q_continuous_slice_ffn_triton(x, starts, swap(w_in_q), w_in_scale, b_in, swap(w_out_q), w_out_scale,
                                             b_out, 5, 4, 16, deterministic=True)
    with pytest.raises(AssertionError, match="max \\|y - ref\\|"):
        assert_matches_reference(y, (x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out), 5, 4, 16,
                                 "swapped")


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_read_as_int8_give_the_same_numbers(bits):
    """TensorRT passes the packed weights as int8 (network.plugin_model retypes them): the device
    kernel reads the same bits either way."""
    inputs = list(make_q_inputs((3,), 31, 27, 6, 2, bits, 16, seed=SEED))
    H, D, K = kernel.check_q_inputs(*inputs, 6, bits, 16)
    as_uint8 = kernel._launch(kernel.q_continuous_slice_ffn_kernel, inputs[0], inputs[1], inputs[2:], H, D, K, 6,
                              True, **kernel.quant_constants(bits, 16))
    inputs[2], inputs[5] = inputs[2].view(torch.int8), inputs[5].view(torch.int8)
    as_int8 = kernel._launch(kernel.q_continuous_slice_ffn_kernel, inputs[0], inputs[1], inputs[2:], H, D, K, 6,
                             True, **kernel.quant_constants(bits, 16))
    assert torch.equal(as_uint8, as_int8)


def test_columns_mode_is_bitwise_reproducible():
    inputs = make_q_inputs((3,), 41, 23, 7, 3, 4, 16, seed=SEED)
    first = kernel.q_continuous_slice_ffn_triton(*inputs, 7, 4, 16, deterministic=True)
    assert torch.equal(first, kernel.q_continuous_slice_ffn_triton(*inputs, 7, 4, 16, deterministic=True))


@pytest.mark.parametrize("deterministic", [True, False], ids=["columns", "split"])
def test_device_kernel_poisons_only_the_bad_token(deterministic):
    H, r = 29, 6
    x, starts, *rest = make_q_inputs((4,), H, 9, r, 3, 8, 16, seed=SEED)
    starts[2, 1] = H - r + 1
    y = kernel.q_continuous_slice_ffn_triton(x, starts, *rest, r, 8, 16, deterministic=deterministic,
                                             check_starts=False)
    assert y[2].isnan().all() and not y[[0, 1, 3]].isnan().any()
    good = [0, 1, 3]
    assert_matches_reference(y[good], (x[good], starts[good], *rest), r, 8, 16, "good tokens")


def _bad(index, value):
    def change(inputs):
        inputs = list(inputs)
        inputs[index] = value(inputs[index])
        return inputs
    return change


@pytest.mark.parametrize("change, bits, block_size, message", [
    (None, 3, 32, "bits must be 4 or 8, got 3"),
    (None, 8, 24, "block size must be a power of two >= 16, got 24"),
    (None, 8, 8, "block size must be a power of two >= 16, got 8"),
    (_bad(2, lambda t: t[:, :-1]), 8, 16, "w_in_q must have shape \\[23, 33\\]"),
    (_bad(5, lambda t: t[:, :16]), 4, 16, "w_out_q must have shape \\[23, 17\\]"),
    (_bad(3, lambda t: t[:, :1]), 8, 16, "w_in_scale must have shape \\[23, 3\\]"),
    (_bad(6, lambda t: t.half()), 8, 16, "w_out_scale must have X's dtype torch.float32"),
    (_bad(2, lambda t: t.view(torch.int8)), 8, 16, "w_in_q must be uint8"),
    (_bad(4, lambda t: t[:-1]), 8, 16, "b_in must have shape \\[23\\]"),
    (_bad(1, lambda t: t + 100), 8, 16, "starts must lie in \\[0, 18\\]"),
    (_bad(0, lambda t: t.double()), 8, 16, "must have X's dtype torch.float64"),
])
def test_bad_input_is_one_line_naming_the_problem(change, bits, block_size, message):
    inputs = make_q_inputs((2,), 23, 33, 5, 2, 8 if bits == 3 else bits, 16 if block_size != 32 else 32, seed=SEED)
    if change:
        inputs = change(inputs)
    with pytest.raises(InfMoEError, match=message) as raised:
        kernel.q_continuous_slice_ffn_triton(*inputs, 5, bits, block_size)
    assert "\n" not in str(raised.value)
