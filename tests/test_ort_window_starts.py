"""`infmoe::WindowStarts` (the onnxruntime target's router and window starts in one node,
docs/reference/ops/WindowStarts.md) against SPEC §3 computed in float64: the compiled kernel and the
fallback function (the standard ops) that runs without it.

A start is floor(sigmoid(z) (H - r + 1)) clamped at H - r: float32 sums in another order may
land on the other side of an integer where the float64 value lies within a hair of it, so such
starts (and only they) may differ by one. Data is fresh every run (the seed is printed in every
failure; INFMOE_TEST_SEED=<n> replays a run).
"""

import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from infmoe_export.export.function import window_starts_model
from infmoe_export.export.ort_target import window_starts_reference
from conftest import with_attributes
from test_ort_qkernel import session

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def make_feeds(rng, lead, d, k, per_token=False, spread=1.0):
    return {"X": rng.standard_normal((*lead, d)).astype(np.float32),
            "weight": (rng.standard_normal((d, 2)) * spread / np.sqrt(d)).astype(np.float32),
            "bias": rng.standard_normal(2).astype(np.float32),
            "eps": rng.standard_normal((*lead, k) if per_token else (k,)).astype(np.float32)}


def assert_starts(starts, feeds, h, r):
    expected, value = window_starts_reference(*feeds.values(), h, r)
    assert starts.shape == expected.shape and starts.dtype == np.int64
    # Within float32's reach of an integer: z's rounding (~1e-6) times sigmoid's slope (<= 1/4)
    # times H - r + 1, with a wide margin.
    near = np.abs(value - np.round(value)) < 1e-4 + 2e-6 * (h - r + 1)
    assert np.array_equal(starts[~near], expected[~near]), f"seed {SEED}"
    assert (np.abs(starts[near] - expected[near]) <= 1).all(), f"seed {SEED}"
    assert ((starts >= 0) & (starts <= h - r)).all()


# (leading dims, D, K, H, r, eps per token): D below 8 and odd, K 1 and many, r = 1 and r = H,
# one token and a prefill's worth (several work items of 64 tokens).
CASES = [((1, 1), 5, 1, 37, 1, False), ((1,), 768, 2, 3072, 384, False), ((2, 3), 97, 8, 200, 13, True),
         ((1, 150), 64, 4, 50, 50, False), ((300,), 13, 3, 1000, 999, True), ((4,), 1, 5, 9, 2, False)]


@pytest.mark.parametrize("lead, d, k, h, r, per_token", CASES)
def test_window_starts_match_spec(library, lead, d, k, h, r, per_token):
    feeds = make_feeds(np.random.default_rng([SEED, d, k, h]), lead, d, k, per_token, spread=3.0)
    assert_starts(session(window_starts_model(h, r).SerializeToString()).run(None, feeds)[0], feeds, h, r)


@pytest.mark.parametrize("lead, d, k, h, r, per_token", CASES[:3])
def test_window_starts_function_matches_spec(lead, d, k, h, r, per_token):
    feeds = make_feeds(np.random.default_rng([SEED, 1, d, k]), lead, d, k, per_token, spread=3.0)
    fallback = ort.InferenceSession(window_starts_model(h, r, with_function=True).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    assert_starts(fallback.run(None, feeds)[0], feeds, h, r)


def test_window_starts_saturate_and_nan(library):
    """z far out gives the first and last start; a NaN in X gives INT64_MIN (as x86's conversion
    does in the fallback), which the expert op then refuses."""
    feeds = make_feeds(np.random.default_rng([SEED, 2]), (3,), 16, 2)
    feeds["weight"][:, 1] = 0.0
    feeds["bias"][:] = [0.0, 0.0]
    feeds["weight"][:, 0] = 0.0
    feeds["X"][2, 4] = np.nan
    feeds["weight"][4, 0] = 1.0
    feeds["X"][0, 4], feeds["X"][1, 4] = 1e4, -1e4
    starts = session(window_starts_model(100, 7).SerializeToString()).run(None, feeds)[0]
    assert starts[0].tolist() == [93, 93] and starts[1].tolist() == [0, 0]
    assert (starts[2] == np.iinfo(np.int64).min).all()


def test_window_starts_bitwise_identical_across_threads(library):
    feeds = make_feeds(np.random.default_rng([SEED, 3]), (2, 300), 130, 8, per_token=True)
    outputs = [session(window_starts_model(500, 30).SerializeToString(), threads).run(None, feeds)[0]
               for threads in (1, 2, 4)]
    assert all(np.array_equal(outputs[0], other) for other in outputs[1:]), f"seed {SEED}"


def _model(attributes):
    return with_attributes(window_starts_model(40, 5), attributes).SerializeToString()


@pytest.mark.parametrize("attributes, message", [
    (dict(slice_width=41), "slice_width must be in \\[1, ffn_hidden\\], got 41 with ffn_hidden = 40"),
    (dict(slice_width=0), "slice_width must be in \\[1, ffn_hidden\\], got 0"),
    (dict(ffn_hidden=None), "attribute 'ffn_hidden'"),
])
def test_window_starts_bad_attributes_are_errors(library, attributes, message):
    with pytest.raises(Exception, match="WindowStarts: .*" + message):
        session(_model(attributes))


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(weight=f["weight"][:7].copy()), r"weight \[7, 2\] must be \[D, 2\] = \[8, 2\]"),
    (lambda f: f.update(bias=np.zeros(3, np.float32)), r"bias \[3\] must be \[2\] = \[2\]"),
    (lambda f: f.update(eps=np.zeros((2, 4, 3), np.float32)),
     r"eps \[2, 4, 3\] must be \[K\] or X's leading dims and K = \[\.\.\., K\] with X \[2, 3, 8\]"),
    (lambda f: f.update(eps=np.zeros(0, np.float32)), r"eps \[0\] must hold at least one sample"),
    (lambda f: f.update(X=np.array(1.0, np.float32)), "X must have at least one dimension"),
])
def test_window_starts_bad_inputs_are_errors(library, change, message):
    feeds = make_feeds(np.random.default_rng([SEED, 4]), (2, 3), 8, 2)
    change(feeds)
    with pytest.raises(Exception, match="WindowStarts: " + message):
        session(_model({})).run(None, feeds)


def test_window_starts_wrong_element_type_is_an_error(library):
    feeds = make_feeds(np.random.default_rng([SEED, 5]), (2,), 8, 2)
    feeds["eps"] = feeds["eps"].astype(np.float64)
    proto = window_starts_model(40, 5)
    next(v for v in proto.graph.input if v.name == "eps").type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(Exception, match="WindowStarts: eps must be float32, got float64"):
        session(proto.SerializeToString()).run(None, feeds)
