"""The compiled onnxruntime kernel (plugins/onnxruntime) against the PyTorch reference op."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from infmoe_export.export.function import op_model
from infmoe_export.model import continuous_slice_ffn
from infmoe_export.runtimes import ort_kernel


def test_library_is_the_one_the_package_build_installed(library, monkeypatch):
    """Without the override, the library comes from the installed distribution (site-packages,
    also for an editable install), never from a build folder of the source tree."""
    monkeypatch.delenv(ort_kernel.ENV_VAR, raising=False)
    path = ort_kernel.custom_op_library()
    assert path is not None and path.is_file()
    assert path.parts[-3:] == ("infmoe_export", "lib", ort_kernel.LIBRARY_NAME)
    files = [file for dist in importlib.metadata.distributions(name=ort_kernel.DISTRIBUTION) for file in dist.files or []]
    assert any(file.as_posix() == ort_kernel.LIBRARY_PATH and pathlib.Path(file.locate()).resolve() == path
               for file in files)


def session(r, dtype="float32", threads=1, activation="gelu_tanh"):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    assert ort_kernel.register(options)
    model = op_model(r, dtype, activation).SerializeToString()
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def make_starts(rng, lead, k, h, r, windows):
    """int64 starts [*lead, k]: 'random', 'overlapping' (within r/2 of each other), 'disjoint'
    (k windows that do not touch), 'edges' (random, with the first at 0 and the last at H - r)."""
    last = h - r
    if windows == "overlapping":
        base = rng.integers(0, last + 1, size=lead + (1,))
        starts = np.clip(base + rng.integers(0, max(1, r // 2), size=lead + (k,)), 0, last)
    elif windows == "disjoint":
        assert k * r <= h
        slack = h - k * r  # spread the free units over k + 1 gaps, in a random order per token
        cuts = np.sort(rng.integers(0, slack + 1, size=lead + (k,)), axis=-1)
        starts = cuts + np.arange(k) * r
        starts = np.take_along_axis(starts, rng.permuted(np.broadcast_to(np.arange(k), starts.shape), axis=-1), -1)
    else:
        starts = rng.integers(0, last + 1, size=lead + (k,))
        if windows == "edges":
            starts[..., 0] = 0
            starts[..., -1] = last
    return starts.astype(np.int64)


def make_feeds(rng, lead, d, h, r, k, windows="random", dtype=np.float32):
    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    return {
        "X": normal(*lead, d),
        "starts": make_starts(rng, lead, k, h, r, windows),
        "w_in": normal(h, d, scale=d ** -0.5),
        "b_in": normal(h, scale=0.5),
        "w_out": normal(h, d, scale=h ** -0.5),
        "b_out": normal(d, scale=0.1),
    }


def reference(feeds, r):
    tensors = [torch.from_numpy(np.asarray(feeds[n])) for n in ("X", "starts", "w_in", "b_in", "w_out", "b_out")]
    tensors = [t if t.dtype == torch.int64 else t.float() for t in tensors]
    return continuous_slice_ffn(*tensors, r).numpy()


def relative_error(y, ref):
    return float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())


# (leading dims, D, H, r, K, windows): odd sizes; one token, a few (decode path) and many
# (prefill path, several GEMM groups); r = 1 and r = H; every K from 1 to 8.
CASES = [
    ((1,), 13, 37, 5, 1, "random"),
    ((1,), 29, 101, 1, 2, "disjoint"),
    ((1,), 17, 41, 41, 3, "random"),          # r = H: the whole FFN, start 0 only
    ((1, 1), 31, 97, 11, 4, "overlapping"),
    ((2,), 23, 83, 9, 5, "edges"),
    ((3,), 19, 61, 7, 6, "disjoint"),
    ((1,), 33, 131, 17, 7, "edges"),
    ((1,), 27, 71, 3, 8, "overlapping"),
    ((5, 13), 21, 89, 13, 1, "edges"),
    ((71,), 37, 113, 1, 2, "random"),
    ((3, 29), 25, 67, 67, 3, "random"),       # r = H with many tokens
    ((2, 3, 11), 15, 53, 6, 4, "disjoint"),
    ((97,), 43, 157, 19, 5, "overlapping"),
    ((4, 17), 35, 127, 10, 6, "edges"),
    ((2, 41), 39, 109, 5, 7, "random"),
    ((67,), 47, 211, 23, 8, "disjoint"),
    # Several prefill groups (128 tokens), hidden blocks (256 units) and output blocks (64 columns).
    ((3, 100), 97, 613, 300, 3, "edges"),
    ((290,), 131, 1031, 1031, 2, "random"),
]


@pytest.mark.parametrize("lead, d, h, r, k, windows", CASES)
def test_matches_reference_fp32(library, lead, d, h, r, k, windows):
    rng = np.random.default_rng([d, h, r, k])
    feeds = make_feeds(rng, lead, d, h, r, k, windows)
    y = session(r).run(None, feeds)[0]
    assert y.shape == lead + (d,) and y.dtype == np.float32
    assert relative_error(y, reference(feeds, r)) <= 1e-5


@pytest.mark.parametrize("lead, d, h, r, k, windows", [((1,), 29, 101, 7, 3, "edges"), ((45,), 33, 87, 12, 4, "random"),
                                                        ((2, 90), 71, 701, 333, 2, "overlapping")])
def test_matches_reference_fp16(library, lead, d, h, r, k, windows):
    rng = np.random.default_rng([k, d])
    feeds = make_feeds(rng, lead, d, h, r, k, windows, dtype=np.float16)
    y = session(r, "float16").run(None, feeds)[0]
    assert y.dtype == np.float16
    # The kernel computes in float32 from the same half inputs; the output is rounded to half.
    assert relative_error(y, reference(feeds, r)) <= 2e-3


def test_large_decode_matches_reference(library):
    """A GPT-2-Small-size layer at one token: long rows, long windows, all 8 samples."""
    rng = np.random.default_rng(7)
    feeds = make_feeds(rng, (1, 1), 768, 6144, 1536, 8, "edges")
    assert relative_error(session(1536, threads=2).run(None, feeds)[0], reference(feeds, 1536)) <= 1e-5


def test_decode_after_thousands_of_windows(library):
    """Decode calls on one thread before and after a call of 3 tokens x 1500 windows (whose plan
    the thread does not keep): each matches the reference."""
    rng = np.random.default_rng()
    calls = [make_feeds(rng, (1, 2), 37, 101, 5, 3), make_feeds(rng, (1, 3), 37, 101, 5, 1500),
             make_feeds(rng, (1, 1), 37, 101, 5, 8)]
    op = session(5, threads=2)
    for feeds in calls:
        assert relative_error(op.run(None, feeds)[0], reference(feeds, 5)) <= 1e-5


@pytest.mark.parametrize("lead", [(1,), (2, 150)])
def test_deterministic_across_runs_and_threads(library, lead):
    rng = np.random.default_rng(11)
    feeds = make_feeds(rng, lead, 130, 1031, 257, 8)
    one, two = session(257, threads=1), session(257, threads=2)
    first = one.run(None, feeds)[0]
    assert np.array_equal(first, one.run(None, feeds)[0])
    assert np.array_equal(first, two.run(None, feeds)[0])
    assert np.array_equal(first, two.run(None, feeds)[0])


@pytest.mark.parametrize("bad_start", [-1, 48 - 9 + 1, 2 ** 40])
def test_out_of_range_start_is_an_error(library, bad_start):
    rng = np.random.default_rng(3)
    feeds = make_feeds(rng, (4,), 16, 48, 9, 2)
    feeds["starts"][2, 1] = bad_start
    with pytest.raises(Exception, match="outside"):
        session(9).run(None, feeds)


MISMATCHES = {
    "w_in": lambda f: f["w_in"][:, :-1],
    "b_in": lambda f: f["b_in"][:-1],
    "w_out": lambda f: f["w_out"][:-2],
    "b_out": lambda f: f["b_out"][:, None],
    "starts": lambda f: f["starts"][:-1],
    "X": lambda f: f["X"][0],
}


@pytest.mark.parametrize("name", MISMATCHES)
def test_mismatched_shape_is_an_error(library, name):
    rng = np.random.default_rng(5)
    feeds = make_feeds(rng, (3,), 16, 48, 9, 2)
    feeds[name] = np.ascontiguousarray(MISMATCHES[name](feeds))
    with pytest.raises(Exception, match="ContinuousSliceFFN"):
        session(9).run(None, feeds)


def test_bad_attributes_are_errors(library):
    rng = np.random.default_rng(6)
    feeds = make_feeds(rng, (2,), 16, 48, 9, 2)
    with pytest.raises(Exception, match="slice_width"):
        session(49).run(None, feeds)  # r > H
    with pytest.raises(Exception, match="unknown activation"):
        session(9, activation="relu")
    with pytest.raises(Exception, match="slice_width"):
        session(0)


@pytest.mark.parametrize("content", [None, b"not a shared library"])
def test_missing_library_falls_back_and_says_so_once(monkeypatch, tmp_path, content):
    path = tmp_path / "libinfmoe_ort.so"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setenv(ort_kernel.ENV_VAR, str(path))
    monkeypatch.setattr(ort_kernel, "_warned", False)
    with pytest.warns(UserWarning, match="fallback"):
        assert ort_kernel.register(ort.SessionOptions()) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ort_kernel.register(ort.SessionOptions()) is False


def test_kernel_takes_precedence_over_the_fallback_function(library):
    """Exported models carry the standard-op function too; with the library registered the
    kernel must run (it alone refuses a bad start), and both must agree on valid input."""
    rng = np.random.default_rng(8)
    feeds = make_feeds(rng, (2, 5), 24, 70, 9, 3, "edges")
    model = op_model(9, with_function=True).SerializeToString()
    options = ort.SessionOptions()
    assert ort_kernel.register(options)
    kernel = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    fallback = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    ref = reference(feeds, 9)
    assert relative_error(kernel.run(None, feeds)[0], ref) <= 1e-5
    assert relative_error(fallback.run(None, feeds)[0], ref) <= 1e-5
    feeds["starts"][0, 0, 0] = 70
    marked = fallback.run(None, feeds)[0]  # the function marks the token's row NaN (spec §6.2)
    assert np.isnan(marked[0, 0]).all() and np.isfinite(np.delete(marked.reshape(-1, 24), 0, axis=0)).all()
    with pytest.raises(Exception, match="outside"):
        kernel.run(None, feeds)


@pytest.mark.parametrize("value", [5, 1.5])
def test_a_non_string_activation_is_refused_not_read_as_the_default(value):
    """An attribute of the wrong type must not pass as "absent" (then: gelu_tanh)."""
    model = op_model(3)
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "activation":
            attribute.CopyFrom(helper.make_attribute("activation", value))
    options = ort.SessionOptions()
    assert ort_kernel.register(options)
    with pytest.raises(Exception, match="activation' must be a string"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name, value", [("INFMOE_CPU_VARIANT", "avx2"), ("INFMOE_CPU_VARIANT", "baseline"),
                                         ("INFMOE_INTEL_STREAMS", "0"), ("INFMOE_INTEL_STREAMS", "1")])
def test_other_variants_and_streamings(library, name, value):
    """The expert op's and the attention's reference and determinism tests again with the
    x86-64-v3 and portable variants, and with float decode's streaming forced each way (one run,
    or Intel's two prefetched runs), whatever this CPU is (each chosen once per process)."""
    if os.environ.get("INFMOE_CPU_VARIANT") or os.environ.get("INFMOE_INTEL_STREAMS"):
        pytest.skip("already running one variant or streaming")
    env = dict(os.environ, **{name: value})
    attention = str(pathlib.Path(__file__).with_name("test_ort_attention.py"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, attention,
                           "-k", "matches_reference or deterministic or matches_the_reference or identical"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{name}={value}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"

