"""Batched decode in the compiled kernel: a call of a few to a few dozen tokens, on each of the
three paths (GEMV, batched, prefill GEMM; INFMOE_PATH forces one, else the path is timed on this
machine), for the float and quantized expert ops and QMatMul.

- every row of a batch of mixed rows (windows overlapping, disjoint, at 0 and at H - r, K = 1 and
  K > 1) matches the reference, and that row run alone, within the op's tolerance;
- on the batched path a row's output is bitwise the same whatever rows share its call.

Data is fresh every run (the seed is printed in every failure; INFMOE_TEST_SEED=<n> replays it).
"""

import os

import numpy as np
import pytest

from conftest import rerun_forcing_path
from test_ort_kernel import make_starts, relative_error
from test_ort_kernel import make_feeds as float_feeds, reference as float_reference, session as float_session
from test_ort_qkernel import make_feeds as q_feeds, q_model, reference as q_reference, session
from test_ort_qmatmul import make_feeds as matmul_feeds, model as matmul_model, reference as matmul_reference

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
PATH = os.environ.get("INFMOE_PATH", "auto")
WINDOWS = ["overlapping", "disjoint", "edges", "random"]
# (D, H, r, K): odd sizes; the tokens 2 to 37 cross the kernel's row blocks (32) and items (256).
SHAPES = [(29, 613, 37, 3), (131, 301, 301, 1), (67, 997, 5, 8)]


def mixed_starts(rng, tokens, k, h, r):
    """Starts for `tokens` rows, each row drawn with another window rule (disjoint where it fits)."""
    rows = []
    for t in range(tokens):
        rule = WINDOWS[t % len(WINDOWS)]
        if rule == "disjoint" and k * r > h:
            rule = "random"
        rows.append(make_starts(rng, (1,), k, h, r, rule))
    return np.concatenate(rows)


def ffn_case(rng, tokens, d, h, r, k, bits):
    if bits is None:
        feeds = float_feeds(rng, (tokens,), d, h, r, k)
        return feeds | {"starts": mixed_starts(rng, tokens, k, h, r)}
    feeds = q_feeds(rng, (tokens,), d, h, r, k, bits, 32)
    return feeds | {"starts": mixed_starts(rng, tokens, k, h, r)}


def run_ffn(sess, feeds):
    return sess.run(None, feeds)[0]


def rows_of(feeds, index, per_token=("X", "starts")):
    return {n: (v[index] if n in per_token else v) for n, v in feeds.items()}


@pytest.mark.parametrize("tokens", [2, 5, 16, 37])
@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("d, h, r, k", SHAPES)
def test_expert_op_batch_rows_match_reference_and_alone(library, d, h, r, k, bits, tokens):
    rng = np.random.default_rng([SEED, d, tokens, bits or 0])
    feeds = ffn_case(rng, tokens, d, h, r, k, bits)
    sess = session(q_model(r, (bits, 32))) if bits else float_session(r)
    y = run_ffn(sess, feeds)
    ref = float_reference(feeds, r) if bits is None else q_reference(feeds, r, bits, 32)
    tolerance = 2e-5
    assert relative_error(y, ref) < tolerance, f"seed {SEED}, path {PATH}"
    for t in range(tokens):
        alone = run_ffn(sess, rows_of(feeds, slice(t, t + 1)))
        assert relative_error(y[t:t + 1], alone.astype(np.float64)) < tolerance, f"seed {SEED}, row {t}, path {PATH}"


@pytest.mark.parametrize("tokens", [2, 7, 33])
@pytest.mark.parametrize("bits", [8, 4])
def test_qmatmul_batch_rows_match_reference_and_alone(library, bits, tokens):
    rng = np.random.default_rng([SEED, tokens, bits])
    feeds = matmul_feeds(rng, (tokens,), 301, 173, bits, 32)
    sess = session(matmul_model(301, 173, bits, 32))
    y = sess.run(None, feeds)[0]
    assert relative_error(y, matmul_reference(feeds, bits, 32)) < 2e-5, f"seed {SEED}, path {PATH}"
    for t in range(tokens):
        alone = sess.run(None, rows_of(feeds, slice(t, t + 1), ("A",)))[0]
        assert relative_error(y[t:t + 1], alone.astype(np.float64)) < 2e-5, f"seed {SEED}, row {t}, path {PATH}"


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_batched_row_does_not_depend_on_its_batch_mates(library, bits):
    """On the batched path, row 0 gives the same bits beside any other rows (same call size)."""
    if PATH != "batched":
        pytest.skip("the batched path's property (run by test_each_path with INFMOE_PATH=batched)")
    d, h, r, k = 67, 997, 5, 8
    rng = np.random.default_rng([SEED, 7])
    sess = session(q_model(r, (bits, 32))) if bits else float_session(r)
    first = ffn_case(rng, 9, d, h, r, k, bits)
    other = ffn_case(rng, 9, d, h, r, k, bits)
    second = dict(first, X=other["X"].copy(), starts=other["starts"].copy())
    for name in ("X", "starts"):
        second[name][0] = first[name][0]
    assert not np.array_equal(second["starts"][1:], first["starts"][1:])
    assert np.array_equal(run_ffn(sess, first)[0], run_ffn(sess, second)[0]), f"seed {SEED}"
    matmul = session(matmul_model(301, 173, 4, 32))
    a = matmul_feeds(rng, (9,), 301, 173, 4, 32)
    b = dict(a, A=rng.standard_normal(a["A"].shape).astype(np.float32))
    b["A"][0] = a["A"][0]
    assert np.array_equal(matmul.run(None, a)[0][0], matmul.run(None, b)[0][0]), f"seed {SEED}"


@pytest.mark.parametrize("path", ["gemv", "batched", "prefill"])
def test_each_path(library, path):
    """The tests above again with each path forced."""
    rerun_forcing_path(__file__, path, SEED)
