"""`infmoe::QMatMul` (the onnxruntime target's quantized attention and LM head) against its
reference `quant.q_matmul` (A times the dequantized w'^T, in float64): the compiled kernel, and
the fallback function (onnxruntime's MatMulNBits) that runs without it.

Data is fresh every run (the seed comes from os.urandom and is printed in every failure;
INFMOE_TEST_SEED=<n> replays a run); weights are normal, never zero.
"""

import os

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from infmoe_export.export.function import qmatmul_model
from infmoe_export.quant import pack_blocks, q_matmul, quantize
from test_ort_kernel import relative_error
from conftest import with_attributes
from test_ort_qkernel import session

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def make_feeds(rng, lead, k, n, bits, block, dtype=np.float32):
    q, scale = quantize(torch.from_numpy(rng.standard_normal((n, k)) * k ** -0.5).float(), bits, block)
    a = rng.standard_normal((*lead, k))
    return {"A": a.astype(dtype), "B": pack_blocks(q, bits, block).numpy(), "scales": scale.numpy().astype(dtype)}


def reference(feeds, bits, block):
    tensors = {name: torch.from_numpy(value) for name, value in feeds.items()}
    return q_matmul(tensors["A"].double(), tensors["B"], tensors["scales"].double(), bits, block).numpy()


def model(k, n, bits, block, dtype=np.float32, attributes=None):
    """The one-node model; `attributes` override the node's (None drops one): the bad-input tests."""
    proto = qmatmul_model(k, n, bits, block, "float16" if dtype == np.float16 else "float32")
    return with_attributes(proto, attributes).SerializeToString()


# (leading dims, K, N, block): K odd or not a multiple of the block (rows padded to whole blocks),
# K below one block, blocks larger than an AVX-512 group (128 int4 columns) and rows of a partial
# last group; up to 3 tokens decode, more prefill (several GEMM groups and row blocks).
CASES = [
    ((1,), 13, 37, 16),
    ((1,), 129, 101, 32),
    ((2,), 601, 131, 16),
    ((3,), 300, 211, 128),
    ((1,), 64, 59, 64),
    ((1,), 100, 77, 256),
    ((1, 1), 768, 1031, 32),
    ((1,), 1000, 3, 64),
    ((4,), 37, 113, 16),
    ((2, 150), 97, 613, 32),
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("lead, k, n, block", CASES)
def test_qmatmul_matches_level_1_reference(library, lead, k, n, block, bits, dtype):
    rng = np.random.default_rng([SEED, k, n, bits])
    feeds = make_feeds(rng, lead, k, n, bits, block, dtype)
    y = session(model(k, n, bits, block, dtype)).run(None, feeds)[0]
    assert y.shape == lead + (n,) and y.dtype == dtype
    tolerance = 1e-5 if dtype == np.float32 else 2e-3
    assert relative_error(y, reference(feeds, bits, block)) <= tolerance, f"seed {SEED}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("lead, k, n, block", [((1,), 129, 101, 32), ((5,), 100, 77, 64)])
def test_qmatmul_function_matches_the_reference(lead, k, n, block, bits):
    """Without the kernel onnxruntime runs the function: its own MatMulNBits on the same storage."""
    feeds = make_feeds(np.random.default_rng([SEED, 7, k, bits]), lead, k, n, bits, block)
    fallback = ort.InferenceSession(qmatmul_model(k, n, bits, block, with_function=True).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    assert relative_error(fallback.run(None, feeds)[0], reference(feeds, bits, block)) <= 1e-5, f"seed {SEED}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale", ["tiny", "huge", "spread"])
def test_qmatmul_activations_of_any_magnitude(library, bits, scale):
    """int4 decode takes A as integers scaled per 8 columns (docs/design/kernel.md)."""
    rng = np.random.default_rng([SEED, 3, bits])
    feeds = make_feeds(rng, (2,), 301, 211, bits, 32)
    factor = {"tiny": 1e-30, "huge": 1e30, "spread": 10.0 ** rng.uniform(-6, 6, feeds["A"].shape)}[scale]
    feeds["A"] = (feeds["A"] * factor).astype(np.float32)
    y = session(model(301, 211, bits, 32)).run(None, feeds)[0]
    assert relative_error(y, reference(feeds, bits, 32)) <= 1e-5, f"seed {SEED}"


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_qmatmul_non_finite_a_gives_a_non_finite_row(library, bad):
    feeds = make_feeds(np.random.default_rng([SEED, 4]), (2,), 301, 211, 4, 32)
    feeds["A"][0, 77] = bad
    y = session(model(301, 211, 4, 32)).run(None, feeds)[0]
    assert not np.isfinite(y[0]).all()
    assert relative_error(y[1:], reference(feeds, 4, 32)[1:]) <= 1e-5, f"seed {SEED}"


def test_qmatmul_nibble_order_matters(library):
    """A planted swap of the nibbles (odd column in the low one) must change the answer."""
    feeds = make_feeds(np.random.default_rng([SEED, 1]), (1,), 32, 64, 4, 16)
    y = session(model(32, 64, 4, 16)).run(None, feeds)[0]
    feeds["B"] = (feeds["B"] >> 4) | ((feeds["B"] & 15) << 4)
    assert relative_error(y, reference(feeds, 4, 16)) > 1e-3, f"seed {SEED}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 150)])
def test_qmatmul_bitwise_identical_across_threads(library, lead, bits):
    feeds = make_feeds(np.random.default_rng([SEED, 2, bits]), lead, 130, 1031, bits, 32)
    outputs = [session(model(130, 1031, bits, 32), threads).run(None, feeds)[0] for threads in (1, 2, 4, 1)]
    for y in outputs[1:]:
        assert np.array_equal(outputs[0], y), f"seed {SEED}"


@pytest.mark.parametrize("attributes, message", [
    (dict(bits=3), "bits must be 4 or 8, got 3"),
    (dict(block_size=24), "block_size must be a power of two >= 16, got 24"),
    (dict(block_size=8), "block_size must be a power of two >= 16, got 8"),
    (dict(K=None), "attribute 'K'"),
    (dict(N=0), "K and N must be >= 1, got K = 16, N = 0"),
])
def test_qmatmul_bad_attributes_are_errors(library, attributes, message):
    with pytest.raises(Exception, match="QMatMul: .*" + message):
        session(model(16, 9, 4, 16, attributes=attributes))


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(A=f["A"][:, :15].copy()), r"A \[3, 15\] must be \[\.\.\., K\] with K = 16"),
    (lambda f: f.update(B=f["B"][:8].copy()), r"B \[8, 1, 8\] must be \[N, ceil\(K / block_size\), block_size \* bits / 8\] "
                                              r"for K = 16, N = 9, bits = 4, block_size = 16 = \[9, 1, 8\]"),
    (lambda f: f.update(B=f["B"].reshape(9, 8)), r"B \[9, 8\] must be"),
    (lambda f: f.update(scales=f["scales"][:, :0].copy()), r"scales \[9, 0\] must be \[N, ceil\(K / block_size\)\]"),
])
def test_qmatmul_bad_inputs_are_errors(library, change, message):
    feeds = make_feeds(np.random.default_rng([SEED, 3]), (3,), 16, 9, 4, 16)
    change(feeds)
    with pytest.raises(Exception, match="QMatMul: " + message):
        session(model(16, 9, 4, 16)).run(None, feeds)


@pytest.mark.parametrize("name, dtype, elem, message", [
    ("scales", np.float16, TensorProto.FLOAT16, "scales must have A's element type float32, got float16"),
    ("B", np.int8, TensorProto.INT8, "B must be uint8, got int8"),
])
def test_qmatmul_wrong_element_types_are_errors(library, name, dtype, elem, message):
    feeds = make_feeds(np.random.default_rng([SEED, 5]), (2,), 16, 9, 4, 16)
    feeds[name] = feeds[name].astype(dtype)
    proto = qmatmul_model(16, 9, 4, 16)
    next(v for v in proto.graph.input if v.name == name).type.tensor_type.elem_type = elem
    with pytest.raises(Exception, match="QMatMul: " + message):
        session(proto.SerializeToString()).run(None, feeds)
