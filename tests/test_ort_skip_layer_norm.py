"""`infmoe::SkipLayerNorm` (the onnxruntime target's residual add and LayerNorm in one node,
docs/reference/ops/SkipLayerNorm.md) against its float64 reference: the compiled kernel and the
fallback function (onnxruntime's SkipLayerNormalization) that runs without it.

The sum output is float32's (input + skip) + bias, bit for bit; the normalized output is within
float32's rounding of the float64 LayerNorm of that sum. Data is fresh every run (the seed is
printed in every failure; INFMOE_TEST_SEED=<n> replays a run), never zeros.
"""

import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from infmoe_export.export.function import skip_layer_norm_model
from infmoe_export.export.ort_target import skip_layer_norm_reference
from conftest import with_attributes
from test_ort_qkernel import session

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
EPSILON = 1e-5
# Within float32's rounding of the float64 value: the output is O(|gamma| + |beta|) and D's sums
# carry a few ulps.
TOLERANCE = 2e-5


def make_feeds(rng, shape, bias=True, offset=0.0):
    d = shape[-1]
    feeds = {"input": (rng.standard_normal(shape) + offset).astype(np.float32),
             "skip": rng.standard_normal(shape).astype(np.float32),
             "gamma": rng.standard_normal(d).astype(np.float32), "beta": rng.standard_normal(d).astype(np.float32)}
    if bias:
        feeds["bias"] = rng.standard_normal(d).astype(np.float32)
    return feeds


def assert_matches(outputs, feeds):
    output, total = outputs
    expected, expected_total = skip_layer_norm_reference(*feeds.values(), epsilon=EPSILON)
    assert output.shape == expected.shape and output.dtype == np.float32
    assert np.array_equal(total, expected_total), f"seed {SEED}"
    scale = np.abs(feeds["gamma"]).max() + np.abs(feeds["beta"]).max()
    assert np.abs(output - expected).max() <= TOLERANCE * scale, f"seed {SEED}"


# (shape, bias): D of 1, below a register, odd and GPT-2's; one row (a decode step), a row's
# worth of the kernel's 16-row work items and more (a prefill), a 2-D and a 3-D input.
CASES = [((1, 1, 768), True), ((1, 1, 768), False), ((3, 5, 37), True), ((17, 9), False), ((2, 150, 97), True),
         ((4, 1), True), ((1, 300, 13), False)]


@pytest.mark.parametrize("shape, bias", CASES)
def test_skip_layer_norm_matches_reference(library, shape, bias):
    feeds = make_feeds(np.random.default_rng([SEED, *shape]), shape, bias)
    assert_matches(session(skip_layer_norm_model(EPSILON, bias).SerializeToString()).run(None, feeds), feeds)


@pytest.mark.parametrize("shape, bias", CASES[:4])
def test_skip_layer_norm_function_matches_reference(shape, bias):
    feeds = make_feeds(np.random.default_rng([SEED, 1, *shape]), shape, bias)
    fallback = ort.InferenceSession(skip_layer_norm_model(EPSILON, bias, with_function=True).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    output, total = fallback.run(None, feeds)
    expected, expected_total = skip_layer_norm_reference(*feeds.values(), epsilon=EPSILON)
    assert np.abs(total - expected_total).max() <= 1e-6 * np.abs(expected_total).max()
    assert np.abs(output - expected).max() <= TOLERANCE * (np.abs(feeds["gamma"]).max() + np.abs(feeds["beta"]).max())


def test_skip_layer_norm_far_from_zero(library):
    """Rows whose mean is large against their spread (a residual stream's drift): the variance
    is taken about the mean, so nothing cancels."""
    feeds = make_feeds(np.random.default_rng([SEED, 2]), (3, 4, 200), offset=1e3)
    assert_matches(session(skip_layer_norm_model(EPSILON).SerializeToString()).run(None, feeds), feeds)


def test_skip_layer_norm_rows_are_their_own(library):
    """A batch's rows equal those rows run alone, bitwise, at any thread count."""
    feeds = make_feeds(np.random.default_rng([SEED, 3]), (2, 300, 130))
    model = skip_layer_norm_model(EPSILON).SerializeToString()
    runs = [session(model, threads).run(None, feeds) for threads in (1, 2, 4)]
    assert all(np.array_equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other)), f"seed {SEED}"
    alone = {name: value[1:2, 7:8] if value.ndim == 3 else value for name, value in feeds.items()}
    output, total = session(model).run(None, alone)
    assert np.array_equal(output, runs[0][0][1:2, 7:8]) and np.array_equal(total, runs[0][1][1:2, 7:8]), f"seed {SEED}"


def test_skip_layer_norm_sum_output_is_optional(library):
    feeds = make_feeds(np.random.default_rng([SEED, 4]), (2, 3, 40))
    proto = skip_layer_norm_model(EPSILON)
    proto.graph.node[0].output[1] = ""
    del proto.graph.output[1]
    (output,) = session(proto.SerializeToString()).run(None, feeds)
    assert np.array_equal(output, session(skip_layer_norm_model(EPSILON).SerializeToString()).run(None, feeds)[0])


@pytest.mark.parametrize("attributes, message", [
    (dict(epsilon=None), "attribute 'epsilon' \\(a float, "),
    (dict(epsilon=-1.0), "epsilon must be finite and >= 0, got -1"),
    (dict(epsilon=float("inf")), "epsilon must be finite and >= 0, got inf"),
])
def test_skip_layer_norm_bad_attributes_are_errors(library, attributes, message):
    with pytest.raises(Exception, match="SkipLayerNorm: " + message):
        session(with_attributes(skip_layer_norm_model(EPSILON), attributes).SerializeToString())


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(skip=f["skip"][:, :2].copy()), r"skip \[2, 2, 8\] must have input's shape \[2, 3, 8\]"),
    (lambda f: f.update(gamma=f["gamma"][:7].copy()), r"gamma \[7\] must be \[D\] = \[8\]"),
    (lambda f: f.update(beta=np.ones((1, 8), np.float32)), r"beta \[1, 8\] must be \[D\] = \[8\]"),
    (lambda f: f.update(bias=np.ones(9, np.float32)), r"bias \[9\] must be \[D\] = \[8\]"),
    (lambda f: f.update(input=np.array(1.0, np.float32), skip=np.array(1.0, np.float32)),
     "input must have at least one dimension"),
    (lambda f: f.update(input=np.ones((2, 0), np.float32), skip=np.ones((2, 0), np.float32)),
     r"input \[2, 0\] must have D >= 1 values a row"),
])
def test_skip_layer_norm_bad_inputs_are_errors(library, change, message):
    feeds = make_feeds(np.random.default_rng([SEED, 5]), (2, 3, 8))
    change(feeds)
    with pytest.raises(Exception, match="SkipLayerNorm: " + message):
        session(skip_layer_norm_model(EPSILON).SerializeToString()).run(None, feeds)


def test_skip_layer_norm_wrong_element_type_is_an_error(library):
    feeds = make_feeds(np.random.default_rng([SEED, 6]), (2, 8))
    feeds["gamma"] = feeds["gamma"].astype(np.float64)
    proto = skip_layer_norm_model(EPSILON)
    next(v for v in proto.graph.input if v.name == "gamma").type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(Exception, match="SkipLayerNorm: gamma must be float32, got float64"):
        session(proto.SerializeToString()).run(None, feeds)
