"""The compiled onnxruntime kernel for `infmoe::QContinuousSliceFFN` (SPEC §6) against the level-1
reference: `quant.q_continuous_slice_ffn`, i.e. the float op on the dequantized weights w'.

Data is fresh every run (the seed comes from os.urandom and is printed in every failure;
INFMOE_TEST_SEED=<n> replays a run); weights are normal, scaled like a trained layer, never zero.
"""

import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from infmoe_export.export.function import op_model
from infmoe_export.quant import QuantizedWeight, q_continuous_slice_ffn
from infmoe_export.runtimes import ort_kernel
from conftest import with_attributes
from test_ort_kernel import make_starts, relative_error

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
NAMES = ("X", "starts", "w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out")


def q_model(r, quantization, dtype=np.float32, types=None, **attributes):
    """The one-node model of the op, quantization = (bits, block size); `types` overrides inputs' element types and `attributes` the
    node's (None drops one): the bad-input tests."""
    bits, block = quantization
    model = with_attributes(op_model(r, "float16" if dtype == np.float16 else "float32", bits=bits, block_size=block),
                            attributes)
    for value_info in model.graph.input:
        if value_info.name in (types or {}):
            value_info.type.tensor_type.elem_type = types[value_info.name]
    return model.SerializeToString()


def session(model, threads=1):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    assert ort_kernel.register(options)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def make_feeds(rng, lead, d, h, r, k, bits, block_size, windows="random", dtype=np.float32):
    def normal(*shape, scale=1.0):
        return torch.from_numpy(rng.standard_normal(shape) * scale).float()

    w_in = QuantizedWeight.of(normal(h, d, scale=d ** -0.5), bits, block_size, torch.float32)
    w_out = QuantizedWeight.of(normal(h, d, scale=h ** -0.5), bits, block_size, torch.float32)
    float_feeds = {"X": normal(*lead, d), "w_in_scale": w_in.scale, "b_in": normal(h, scale=0.5),
                   "w_out_scale": w_out.scale, "b_out": normal(d, scale=0.1)}
    feeds = {n: v.numpy().astype(dtype) for n, v in float_feeds.items()}
    feeds.update(starts=make_starts(rng, lead, k, h, r, windows), w_in_q=w_in.packed.numpy(),
                 w_out_q=w_out.packed.numpy())
    return {n: feeds[n] for n in NAMES}


def reference(feeds, r, bits, block_size):
    """Level 1: the reference op on the inputs the kernel saw, in float32."""
    tensors = [torch.from_numpy(feeds[n]) for n in NAMES]
    tensors = [t.float() if t.is_floating_point() else t for t in tensors]
    return q_continuous_slice_ffn(*tensors, r, bits, block_size).numpy()


# (leading dims, D, H, r, K, windows, block size): H a prime, D not a multiple of the block (odd
# D for int4's pad nibble), r = 1 and r = H, K = 1 and K > 1; one token and three (decode), many
# (prefill, several groups and hidden blocks).
CASES = [
    ((1,), 13, 37, 5, 1, "edges", 16),
    ((1,), 29, 101, 1, 2, "disjoint", 16),
    ((1,), 17, 41, 41, 3, "random", 32),        # r = H: start 0 only
    ((1, 1), 31, 97, 11, 4, "overlapping", 16),
    ((3,), 47, 83, 9, 5, "edges", 32),
    ((1,), 770, 613, 37, 8, "disjoint", 64),    # long rows, several units per block, a partial last
    ((1,), 768, 1031, 300, 2, "overlapping", 32),
    ((71,), 37, 113, 1, 2, "random", 16),
    ((3, 29), 25, 67, 67, 3, "edges", 16),      # r = H with many tokens
    ((97,), 43, 157, 19, 1, "edges", 128),
    ((2, 150), 97, 613, 200, 3, "disjoint", 32),  # several prefill groups and hidden blocks
    # Decode on AVX-512 reads rows in groups of 64 bytes (128 int4 / 64 int8 columns): a partial
    # last group, groups with several blocks, and blocks spanning several groups (B 128, 256).
    ((1,), 601, 131, 7, 1, "edges", 16),
    ((2,), 300, 211, 50, 2, "overlapping", 128),
    ((3,), 601, 97, 13, 3, "edges", 256),
    ((1,), 64, 59, 59, 1, "random", 64),          # exactly one int8 group, r = H
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("lead, d, h, r, k, windows, block", CASES)
def test_matches_level_1_reference(library, lead, d, h, r, k, windows, block, bits, dtype):
    rng = np.random.default_rng([SEED, d, h, r, k, bits])
    feeds = make_feeds(rng, lead, d, h, r, k, bits, block, windows, dtype)
    y = session(q_model(r, (bits, block), dtype)).run(None, feeds)[0]
    assert y.shape == lead + (d,) and y.dtype == dtype
    # float32: w' and the sums in float32, like the float op (SPEC §6, level 1 with the float
    # tolerances); float16: the same from half inputs, Y rounded to half once.
    tolerance = 1e-5 if dtype == np.float32 else 2e-3
    assert relative_error(y, reference(feeds, r, bits, block)) <= tolerance, f"seed {SEED}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale", ["tiny", "huge", "spread"])
def test_decode_activations_of_any_magnitude(library, bits, scale):
    """AVX-512 decode multiplies int4 rows by x as integers, scaled per 8 columns by a power of two
    (docs/design/kernel.md): x of 1e-30 or 1e30 times the usual, and x spanning 12 orders of
    magnitude within every 8 columns, stay within the float tolerance."""
    rng = np.random.default_rng([SEED, 3, bits])
    feeds = make_feeds(rng, (2,), 301, 211, 50, 2, bits, 32)
    factor = {"tiny": 1e-30, "huge": 1e30, "spread": 10.0 ** rng.uniform(-6, 6, feeds["X"].shape)}[scale]
    feeds["X"] = (feeds["X"] * factor).astype(np.float32)
    if scale != "spread":  # keep the biases from hiding x's share of the result
        feeds["b_in"] *= np.float32(factor)
        feeds["b_out"] *= np.float32(factor)
    y = session(q_model(50, (bits, 32))).run(None, feeds)[0]
    assert relative_error(y, reference(feeds, 50, bits, 32)) <= 1e-5, f"seed {SEED}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_decode_non_finite_x_gives_a_non_finite_row(library, bits, bad):
    """A NaN or infinite activation reaches the token's output, as in the float reference, and
    leaves the other token alone."""
    rng = np.random.default_rng([SEED, 4, bits])
    feeds = make_feeds(rng, (2,), 301, 211, 50, 2, bits, 32)
    feeds["X"][0, 77] = bad
    y = session(q_model(50, (bits, 32))).run(None, feeds)[0]
    ref = reference(feeds, 50, bits, 32)
    assert not np.isfinite(y[0]).any() and not np.isfinite(ref[0]).any()
    assert relative_error(y[1:], ref[1:]) <= 1e-5, f"seed {SEED}"


def test_nibble_order_matters(library):
    """A planted swap of the nibbles (odd column in the low one) must change the answer."""
    rng = np.random.default_rng([SEED, 1])
    feeds = make_feeds(rng, (1,), 32, 64, 16, 2, 4, 16)
    y = session(q_model(16, (4, 16))).run(None, feeds)[0]
    for name in ("w_in_q", "w_out_q"):
        q = feeds[name]
        feeds[name] = (q >> 4) | ((q & 15) << 4)
    assert relative_error(y, reference(feeds, 16, 4, 16)) > 1e-3, f"seed {SEED}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 150)])
def test_bitwise_identical_across_threads(library, lead, bits):
    rng = np.random.default_rng([SEED, 2, bits])
    feeds = make_feeds(rng, lead, 130, 1031, 257, 8, bits, 32)
    model = q_model(257, (bits, 32))
    outputs = [session(model, threads).run(None, feeds)[0] for threads in (1, 2, 4, 1)]
    for y in outputs[1:]:
        assert np.array_equal(outputs[0], y), f"seed {SEED}"


@pytest.mark.parametrize("attributes, message", [
    (dict(bits=3), "bits must be 4 or 8, got 3"),
    (dict(bits=None), "attribute 'bits'"),
    (dict(block_size=24), "block_size must be a power of two >= 16, got 24"),
    (dict(block_size=8), "block_size must be a power of two >= 16, got 8"),
    (dict(block_size=0), "block_size must be a power of two >= 16, got 0"),
    (dict(block_size=1.5), "attribute 'block_size'"),
    (dict(activation="relu"), "unknown activation 'relu'"),
    (dict(slice_width=0), "slice_width must be >= 1"),
])
def test_bad_attributes_are_errors(library, attributes, message):
    with pytest.raises(Exception, match="QContinuousSliceFFN: .*" + message):
        session(q_model(9, (4, 16), **attributes))


def shrink(feeds, name, axis):
    feeds[name] = np.ascontiguousarray(np.delete(feeds[name], -1, axis=axis))


@pytest.mark.parametrize("change, message", [
    (lambda f: shrink(f, "w_in_q", 1), r"w_in_q \[48, 7\] must be \[H, 8\] for D = 16, bits = 4"),
    (lambda f: shrink(f, "w_out_q", 0), r"w_out_q \[47, 8\] must be \[H, 8\]"),
    (lambda f: f.update(w_in_q=np.zeros((48, 16), np.uint8)), r"w_in_q \[48, 16\] must be \[H, 8\]"),
    (lambda f: shrink(f, "w_in_scale", 1), r"w_in_scale \[48, 0\] must be \[H, ceil\(D / block_size\)\]"),
    (lambda f: f.update(w_out_scale=np.ones((48, 2), np.float32)), r"w_out_scale \[48, 2\] must be"),
    (lambda f: shrink(f, "b_in", 0), r"b_in \[47\] must be \[H\] = \[48\]"),
    (lambda f: shrink(f, "b_out", 0), r"b_out \[15\] must be \[D\] = \[16\]"),
    (lambda f: shrink(f, "starts", 0), r"starts \[2, 2\] must have the leading dims of X \[3, 16\]"),
    (lambda f: f["starts"].__setitem__((2, 1), 40), r"starts\[5\] = 40 is outside \[0, 39\]"),
    (lambda f: f["starts"].__setitem__((0, 0), -1), r"starts\[0\] = -1 is outside"),
    (lambda f: f["starts"].__setitem__((1, 0), 2 ** 40), r"starts\[2\] = 1099511627776 is outside"),
])
def test_bad_inputs_are_errors(library, change, message):
    rng = np.random.default_rng([SEED, 3])
    feeds = make_feeds(rng, (3,), 16, 48, 9, 2, 4, 16)
    change(feeds)
    with pytest.raises(Exception, match="QContinuousSliceFFN: " + message):
        session(q_model(9, (4, 16))).run(None, feeds)


def test_slice_width_larger_than_h_is_an_error(library):
    feeds = make_feeds(np.random.default_rng([SEED, 4]), (2,), 16, 48, 9, 2, 8, 16)
    with pytest.raises(Exception, match="slice_width 49 is larger than H = 48"):
        session(q_model(49, (8, 16))).run(None, feeds)


@pytest.mark.parametrize("name, dtype, message", [
    ("w_in_scale", np.float16, "w_in_scale must have X's element type float32, got float16"),
    ("w_out_scale", np.float16, "w_out_scale must have X's element type float32, got float16"),
    ("b_in", np.float64, "b_in must have X's element type float32, got float64"),
    ("w_in_q", np.int8, "w_in_q must be uint8, got int8"),
])
def test_wrong_element_types_are_errors(library, name, dtype, message):
    feeds = make_feeds(np.random.default_rng([SEED, 5]), (2,), 16, 48, 9, 2, 8, 16)
    feeds[name] = feeds[name].astype(dtype)
    types = {name: helper.np_dtype_to_tensor_dtype(np.dtype(dtype))}
    with pytest.raises(Exception, match="QContinuousSliceFFN: " + message):
        session(q_model(9, (8, 16), types=types)).run(None, feeds)


def test_float16_x_refuses_float32_scales(library):
    feeds = make_feeds(np.random.default_rng([SEED, 6]), (1,), 16, 48, 9, 2, 4, 16, dtype=np.float16)
    feeds["w_out_scale"] = feeds["w_out_scale"].astype(np.float32)
    model = q_model(9, (4, 16), np.float16, types={"w_out_scale": TensorProto.FLOAT})
    with pytest.raises(Exception, match="w_out_scale must have X's element type float16, got float32"):
        session(model).run(None, feeds)


@pytest.mark.parametrize("variant", ["avx2", "baseline"])
def test_narrower_cpu_variants(library, variant):
    """The reference and determinism tests of both quantized ops (QMatMul's in test_ort_qmatmul.py)
    again with the x86-64-v3 and portable variants (the widest one the CPU supports runs
    everywhere else); the variant is chosen once per process."""
    if os.environ.get("INFMOE_CPU_VARIANT"):
        pytest.skip("already running one variant")
    env = dict(os.environ, INFMOE_CPU_VARIANT=variant, INFMOE_TEST_SEED=str(SEED))
    qmatmul = os.path.join(os.path.dirname(__file__), "test_ort_qmatmul.py")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, qmatmul,
                           "-k", "matches_level_1 or bitwise or nibble"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{variant}, seed {SEED}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"

