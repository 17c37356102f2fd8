"""`infmoe::StepInputs` (the onnxruntime target's once-per-step inputs in one node,
docs/reference/ops/StepInputs.md) against a numpy reference: the compiled kernel and the fallback
function (the thirteen standard ops) that runs without it, on left-padded masks of odd lengths,
decode and prefill, and masks of other values than 0 and 1 (which both must compute alike). Data
is fresh every run (the seed is printed in every failure; INFMOE_TEST_SEED=<n> replays a run).
"""

import os

import numpy as np
import onnxruntime as ort
import pytest

from infmoe_export.export.function import step_inputs_model
from infmoe_export.export.ort_target import step_inputs_reference as reference
from test_ort_qkernel import session

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def make_feeds(rng, batch, sequence, total, values=(0, 1)):
    """Rows left-padded by a random count (each row's real tokens at the end), or, with other
    values, a mask drawn from them."""
    if values == (0, 1):
        pads = rng.integers(0, total - sequence + 1, size=batch)
        mask = (np.arange(total)[None, :] >= pads[:, None]).astype(np.int64)
    else:
        mask = rng.choice(np.array(values, np.int64), size=(batch, total))
    return {"input_ids": rng.integers(0, 256, size=(batch, sequence)), "attention_mask": mask}


def assert_outputs(outputs, expected):
    for got, want in zip(outputs, expected):
        assert got.dtype == want.dtype and got.shape == want.shape, f"seed {SEED}"
        assert np.array_equal(got, want), f"seed {SEED}"


# (batch, sequence, total, mask values): decode (sequence 1-3) and prefill (sequence = total, or
# with a past), batch 1 and more, odd lengths; masks of 0 and 1, and of other values.
CASES = [(1, 1, 1, (0, 1)), (1, 1, 129, (0, 1)), (3, 1, 77, (0, 1)), (2, 3, 50, (0, 1)), (2, 37, 37, (0, 1)),
         (3, 20, 301, (0, 1)), (2, 5, 40, (0, 1, 2, -3)), (1, 1, 9, (0, -1))]


@pytest.mark.parametrize("batch, sequence, total, values", CASES)
def test_step_inputs_match_the_reference(library, batch, sequence, total, values):
    feeds = make_feeds(np.random.default_rng([SEED, batch, sequence, total]), batch, sequence, total, values)
    assert_outputs(session(step_inputs_model().SerializeToString()).run(None, feeds), reference(**feeds))


@pytest.mark.parametrize("batch, sequence, total, values", CASES)
def test_step_inputs_function_matches_the_reference(batch, sequence, total, values):
    """Without the kernel onnxruntime runs the function: the standard ops the target wrote before."""
    feeds = make_feeds(np.random.default_rng([SEED, 7, batch, sequence, total]), batch, sequence, total, values)
    fallback = ort.InferenceSession(step_inputs_model(with_function=True).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    assert_outputs(fallback.run(None, feeds), reference(**feeds))


@pytest.mark.parametrize("ids, mask, message", [
    ((1, 2, 3), (1, 3), r"input_ids \[1, 2, 3\] must be \[batch, sequence\]"),
    ((2, 1), (1, 5), r"attention_mask \[1, 5\] must be \[batch, total\] with input_ids \[2, 1\]"),
    ((1, 6), (1, 5), r"attention_mask \[1, 5\] must be \[batch, total\] with input_ids \[1, 6\] \(total >= max\(sequence, 1\)\)"),
    ((1, 0), (1, 0), r"attention_mask \[1, 0\] must be"),
    ((2, 1), (2, 1, 5), r"attention_mask \[2, 1, 5\] must be"),
    ((1, 40000), (1, 40000), r"attention_bias \[1, 1, 40000, 40000\] would hold more than 2\^30 values"),
])
def test_step_inputs_bad_shapes_are_errors(library, ids, mask, message):
    """Refused by name before anything is allocated (the last: 6.4 GB of bias)."""
    feeds = {"input_ids": np.zeros(ids, np.int64), "attention_mask": np.ones(mask, np.int64)}
    with pytest.raises(Exception, match="StepInputs: " + message):
        session(step_inputs_model().SerializeToString()).run(None, feeds)
