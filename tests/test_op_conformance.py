"""One conformance table for `infmoe::ContinuousSliceFFN`: every implementation, the same cases,
the same verdicts (docs/reference/spec.md §6.7).

Implementations (rows of IMPLEMENTATIONS):

    torch           model.continuous_slice_ffn, float32                               raises
    function-fp32   the standard-op fallback function in onnxruntime, no kernel         graph
    function-fp16   the same, float16                                                   graph
    kernel-fp32     the C++ kernel (onnxruntime CPU, library registered)                raises
    kernel-fp16     the same, float16                                                   raises
    triton-fp32     the Triton launcher, SPLIT mode (decode), in the CPU interpreter    raises
                    (conftest.py sets TRITON_INTERPRET=1 before anything imports triton)
    triton-fp16     the launcher, COLUMNS mode (what TensorRT runs), float16             raises
    triton-device   the Triton kernel without the launcher's start check, COLUMNS       graph
                    mode: what a TensorRT engine runs, where no host check exists
    cuda-fp32/fp16  the CUDA kernel (onnxruntime CUDA EP, library registered)           raises

Valid cases: every implementation matches the float64 reference computed from the same
(dtype-rounded) inputs. Invalid cases: a "raises" implementation raises (InfMoEError, one line,
naming the rule, for the Python ones); a "graph" implementation either makes its runtime fail
or returns NaN in every element of every affected row -- the rows of the tokens with a bad
start (the other tokens' rows stay correct), or all rows when the whole call is invalid.
A finite answer to an invalid input is a failure everywhere.

Tolerances, |y - ref| <= tol * max|ref| (ref in float64 from the inputs each implementation saw):
  float32                       5e-6  (D + r products accumulated in float32; 4.4e-7 is the worst
                                      seen over 12 seeds x every case here)
  float16, float32 accumulation 1e-3  (C++, CUDA, Triton: Y rounded to float16 once, 2^-11
                                      relative to an element; 4.1e-4 seen)
  float16 function              1e-2  (a runtime may evaluate every op in float16, each product
                                      and partial sum rounded to 11 bits; onnxruntime's CPU
                                      provider here widens, 4.1e-4 seen)

Data is fresh every run (normal weights scaled like a trained layer, never zero); the seed comes
from os.urandom and is printed in every failure; INFMOE_TEST_SEED=<n> replays a run.
"""

import functools
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from infmoe_export.errors import InfMoEError
from infmoe_export.export.function import op_model
from infmoe_export.model import continuous_slice_ffn
from infmoe_export.runtimes import ort_kernel

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
NAMES = ("X", "starts", "w_in", "b_in", "w_out", "b_out")
INT64_MIN, INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
ORT_ERRORS = "onnxruntime.capi.onnxruntime_pybind11_state"  # Fail, InvalidArgument, ...: onnxruntime refused


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    name: str
    lead: Tuple[int, ...]
    H: int
    D: int
    r: int
    K: int
    windows: str = "random"                # how the starts are drawn, see make_starts
    # Invalid cases: a change to the valid inputs, the tokens it makes invalid (None: the whole
    # call), and what the Python implementations' message must say.
    change: Optional[Callable] = field(default=None, compare=False)
    bad_tokens: Optional[Tuple[int, ...]] = None
    message: str = ""


def make_starts(rng, lead, H, r, K, windows):
    """int64 [*lead, K]. random: uniform; overlapping: within r/2 of each other, one repeated;
    disjoint: K windows that do not touch, in random order. Every kind puts a window at 0 in the
    first token and one at H - r in the last."""
    last = H - r
    if windows == "overlapping":
        base = rng.integers(0, last + 1, lead + (1,))
        starts = np.clip(base + rng.integers(0, max(1, r // 2), lead + (K,)), 0, last)
        if K > 1:
            starts[..., -1] = starts[..., 0]
    elif windows == "disjoint":
        slack = H - K * r
        assert slack >= 0
        cuts = np.sort(rng.integers(0, slack + 1, lead + (K,)), axis=-1)
        starts = cuts + np.arange(K) * r
        flat = starts.reshape(-1, K)
        flat[0], flat[-1] = np.arange(K) * r, np.arange(K) * r + slack
        starts = rng.permuted(starts, axis=-1)
    else:
        starts = rng.integers(0, last + 1, lead + (K,))
    flat = starts.reshape(-1, K)
    if windows != "disjoint":
        flat[0, 0], flat[-1, -1] = 0, last
    return np.ascontiguousarray(starts, dtype=np.int64)


def make_inputs(case: Case, seed):
    """Fresh float64 inputs: weights scaled like a trained layer so that outputs stay O(1)."""
    rng = np.random.default_rng(seed)
    lead, H, D, r = case.lead, case.H, case.D, case.r
    return {
        "X": rng.standard_normal(lead + (D,)),
        "starts": make_starts(rng, lead, H, r, case.K, case.windows),
        "w_in": rng.standard_normal((H, D)) / D ** 0.5,
        "b_in": rng.standard_normal(H) * 0.5,
        "w_out": rng.standard_normal((H, D)) / r ** 0.5,
        "b_out": rng.standard_normal(D) * 0.5,
    }


VALID = [
    Case("T3-K1-edges", (3,), H=37, D=13, r=5, K=1),
    Case("BT-K4-overlapping", (2, 3), H=37, D=13, r=11, K=4, windows="overlapping"),
    Case("T4-K3-disjoint-H101", (4,), H=101, D=7, r=9, K=3, windows="disjoint"),
    Case("BT-r1", (2, 2), H=37, D=9, r=1, K=3),
    Case("T2-r1-disjoint", (2,), H=37, D=9, r=1, K=5, windows="disjoint"),
    Case("T3-r=H", (3,), H=37, D=11, r=37, K=2),
    Case("BT-K8-H101", (2, 5), H=101, D=15, r=23, K=8),            # 10 tokens: the C++ prefill path
    Case("one-token-no-lead", (), H=37, D=5, r=4, K=2, windows="overlapping"),
]


def _set(name, value):
    def change(f):
        f[name] = value(f) if callable(value) else value
    return change


def _start(index, value):
    def change(f):
        f["starts"][index] = value
    return change


BASE = dict(lead=(3,), H=37, D=13, r=5, K=2)
INVALID = [
    Case("start-negative", **BASE, change=_start((1, 1), -1), bad_tokens=(1,), message="starts must lie in"),
    Case("start-past-H-r", **BASE, change=_start((1, 0), 37 - 5 + 1), bad_tokens=(1,), message="starts must lie in"),
    Case("start-int64-min", **BASE, change=_start((2, 1), INT64_MIN), bad_tokens=(2,), message="starts must lie in"),
    Case("start-int64-max", **BASE, change=_start((0, 0), INT64_MAX), bad_tokens=(0,), message="starts must lie in"),
    Case("K=0", **BASE, change=_set("starts", lambda f: f["starts"][:, :0].copy()), message="K >= 1"),
    Case("slice_width-0", **BASE, change=_set("r", 0), message="slice_width"),
    Case("slice_width-above-H", **BASE, change=_set("r", 38), message="slice_width"),
    Case("unknown-activation", **BASE, change=_set("activation", "relu"), message="unknown activation"),
    # Shapes: the first four would broadcast in standard ops without the function's shape check.
    Case("starts-lead-1", **BASE, change=_set("starts", lambda f: f["starts"][:1].copy()),
         message="starts must have shape"),
    Case("starts-rank-1", **BASE, change=_set("starts", lambda f: f["starts"][0].copy()),
         message="starts must have shape"),
    Case("b_in-length-1", **BASE, change=_set("b_in", lambda f: f["b_in"][:1].copy()),
         message="b_in must have shape"),
    Case("b_out-length-1", **BASE, change=_set("b_out", lambda f: f["b_out"][:1].copy()),
         message="b_out must have shape"),
    Case("b_out-rank-2", **BASE, change=_set("b_out", lambda f: f["b_out"][:, None].copy()),
         message="b_out must have shape"),
    Case("X-rank-1", **BASE, change=_set("X", lambda f: f["X"][0].copy()), message="starts must have shape"),
    Case("w_in-D-1", **BASE, change=_set("w_in", lambda f: f["w_in"][:, :-1].copy()),
         message="w_in must have shape"),
    Case("w_out-H-1", **BASE, change=_set("w_out", lambda f: f["w_out"][:-1].copy()),
         message="w_out must have shape"),
    # Dtypes (ONNX implementations: the model declares the wrong type, as a mistyped graph would).
    Case("starts-int32", **BASE, change=_set("starts", lambda f: f["starts"].astype(np.int32)),
         message="starts must be int64"),
    Case("starts-float-nan", **BASE, change=_set("starts", lambda f: np.where(f["starts"] > 2, np.nan, f["starts"])),
         message="starts must be int64"),  # NaN has no range: refused for its dtype, not by a ValueError
    Case("w_out-other-float", **BASE, change=_set("w_out_dtype", "other"), message="w_out must have X's dtype"),
]


# ---------------------------------------------------------------------------------------------
# Implementations: run(feeds, r, activation) -> Y as numpy in the implementation's dtype, or raise


def _library():
    return ort_kernel.custom_op_library()


def _cuda_available():
    return "CUDAExecutionProvider" in ort.get_available_providers() and _library() is not None


@functools.lru_cache(maxsize=None)
def _session(kind, r, activation, types):
    """An onnxruntime session of op_model; types: the element type of each input."""
    model = op_model(r, "float32", activation, with_function=kind == "function")
    for value, elem in zip(model.graph.input, types):
        value.type.tensor_type.elem_type = elem
    model.graph.output[0].type.tensor_type.elem_type = types[0]
    options = ort.SessionOptions()
    options.log_severity_level = 4  # the expected failures are reported by the exception
    options.intra_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if kind in ("kernel", "cuda"):
        assert ort_kernel.register(options)
    if kind == "cuda":
        providers = ["CUDAExecutionProvider"]
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # the CUDA kernel or nothing
    return ort.InferenceSession(model.SerializeToString(), options, providers=providers)


def _ort(kind):
    def run(feeds, r, activation):
        types = tuple(onnx.helper.np_dtype_to_tensor_dtype(feeds[n].dtype) for n in NAMES)
        return _session(kind, r, activation, types).run(None, feeds)[0]
    return run


def _torch(feeds, r, activation):
    tensors = [torch.from_numpy(feeds[n]) for n in NAMES]
    return continuous_slice_ffn(*tensors, r, activation).numpy()


def _triton(deterministic, check_starts=True):
    def run(feeds, r, activation):
        from infmoe_export.runtimes.tensorrt.plugin import triton_kernel  # imported here: only the Triton rows need triton
        tensors = [torch.from_numpy(feeds[n]) for n in NAMES]
        return triton_kernel.continuous_slice_ffn_triton(*tensors, r, activation, deterministic=deterministic,
                                                         check_starts=check_starts).numpy()
    return run


def _needs_triton():
    try:
        import triton  # noqa: F401
        from infmoe_export.runtimes.tensorrt.plugin import triton_kernel  # noqa: F401
    except ImportError as error:
        return f"Triton or the Triton kernel is not importable: {error}"
    return None


def _needs_library():
    return None if _library() is not None else "the onnxruntime kernel library is not built"


def _needs_cuda():
    return None if _cuda_available() else "no GPU with onnxruntime's CUDAExecutionProvider and the kernel library"


@dataclass(frozen=True)
class Implementation:
    name: str
    run: Callable
    dtype: type
    verdict: str              # "raises" or "graph"
    tolerance: float
    python: bool = False      # raises InfMoEError with the spec's message (else: an onnxruntime error)
    needs: Callable = lambda: None


IMPLEMENTATIONS = [
    Implementation("torch", _torch, np.float32, "raises", 5e-6, python=True),
    Implementation("function-fp32", _ort("function"), np.float32, "graph", 5e-6),
    Implementation("function-fp16", _ort("function"), np.float16, "graph", 1e-2),
    Implementation("kernel-fp32", _ort("kernel"), np.float32, "raises", 5e-6, needs=_needs_library),
    Implementation("kernel-fp16", _ort("kernel"), np.float16, "raises", 1e-3, needs=_needs_library),
    Implementation("triton-fp32", _triton(False), np.float32, "raises", 5e-6, python=True, needs=_needs_triton),
    Implementation("triton-fp16", _triton(True), np.float16, "raises", 1e-3, python=True, needs=_needs_triton),
    Implementation("triton-device", _triton(True, check_starts=False), np.float32, "graph", 5e-6,
                   python=True, needs=_needs_triton),
    Implementation("cuda-fp32", _ort("cuda"), np.float32, "raises", 5e-6, needs=_needs_cuda),
    Implementation("cuda-fp16", _ort("cuda"), np.float16, "raises", 1e-3, needs=_needs_cuda),
]


def _prepare(case: Case, impl: Implementation, seed):
    """(feeds in the implementation's dtype, r, activation, float64 reference or None)."""
    feeds = make_inputs(case, seed)
    feeds = {n: v if n == "starts" else v.astype(impl.dtype) for n, v in feeds.items()}
    # The reference sees exactly what the implementation sees: the dtype-rounded inputs.
    ref = continuous_slice_ffn(*[torch.from_numpy(feeds[n].astype(np.int64 if n == "starts" else np.float64))
                                 for n in NAMES], case.r).numpy()
    settings = {"r": case.r, "activation": "gelu_tanh", "w_out_dtype": None}
    if case.change is not None:
        target = dict(feeds, **settings)
        case.change(target)
        feeds = {n: target[n] for n in NAMES}
        settings = {k: target[k] for k in settings}
        if settings["w_out_dtype"] == "other":
            feeds["w_out"] = feeds["w_out"].astype(np.float16 if impl.dtype == np.float32 else np.float32)
    return feeds, settings["r"], settings["activation"], ref


def _skip_reason(impl):
    reason = impl.needs()
    if reason:
        pytest.skip(f"{impl.name}: {reason}")


IDS = [i.name for i in IMPLEMENTATIONS]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=IDS)
@pytest.mark.parametrize("case", VALID, ids=[c.name for c in VALID])
def test_valid_input_matches_reference(case, impl):
    _skip_reason(impl)
    seed = (SEED, VALID.index(case))
    feeds, r, activation, ref = _prepare(case, impl, seed)
    where = f"{impl.name} on {case.name}, seed {SEED} (INFMOE_TEST_SEED={SEED} replays it)"
    y = impl.run(feeds, r, activation)
    assert y.shape == ref.shape and y.dtype == impl.dtype, f"{where}: got {y.shape} {y.dtype}"
    scale = np.abs(ref).max()
    assert scale > 0.1, f"{where}: degenerate data, max |ref| = {scale}"
    error = np.abs(y.astype(np.float64) - ref).max()
    assert error <= impl.tolerance * scale, f"{where}: max abs error {error:.3g} > {impl.tolerance} * {scale:.3g}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=IDS)
@pytest.mark.parametrize("case", INVALID, ids=[c.name for c in INVALID])
def test_invalid_input_is_refused(case, impl):
    _skip_reason(impl)
    seed = (SEED, 1000 + INVALID.index(case))
    feeds, r, activation, ref = _prepare(case, impl, seed)
    where = f"{impl.name} on {case.name}, seed {SEED}"
    try:
        y = impl.run(feeds, r, activation)
    except Exception as error:  # noqa: BLE001 -- checked below: the runtime's refusal, not a test bug
        if impl.python:
            assert isinstance(error, InfMoEError), f"{where}: raised {type(error).__name__}: {error}"
            assert case.message in str(error) and "\n" not in str(error), f"{where}: message {str(error)!r}"
        else:
            assert type(error).__module__ == ORT_ERRORS, f"{where}: raised {type(error).__name__}: {error}"
        return  # refused by raising: the verdict of a raising implementation, and allowed in a graph
    assert impl.verdict == "graph", f"{where}: a raising implementation answered instead of refusing"
    nan_rows = np.isnan(y).all(axis=-1)
    if case.bad_tokens is None:
        assert nan_rows.all(), f"{where}: a finite answer to an invalid call ({(~nan_rows).sum()} rows not NaN)"
        return
    flat_y, flat_ref = y.reshape(-1, case.D).astype(np.float64), ref.reshape(-1, case.D)
    bad = np.zeros(len(flat_y), dtype=bool)
    bad[list(case.bad_tokens)] = True
    assert np.isnan(flat_y[bad]).all(), f"{where}: the rows of tokens {case.bad_tokens} are not all NaN"
    # The other tokens are unaffected (ref is the valid input before the change: the same rows).
    error = np.abs(flat_y[~bad] - flat_ref[~bad]).max()
    assert error <= impl.tolerance * np.abs(flat_ref).max(), f"{where}: valid tokens off by {error:.3g}"


def test_seed_varies_data():
    """The data come from the run's seed, so each run tests fresh numbers (and a seed replays them)."""
    a, b = make_inputs(VALID[0], (SEED, 0)), make_inputs(VALID[0], (SEED + 1, 0))
    assert not np.array_equal(a["X"], b["X"])
    assert all(np.array_equal(v, make_inputs(VALID[0], (SEED, 0))[n]) for n, v in a.items())
    assert all(np.abs(v).min() > 0 for n, v in a.items() if n != "starts"), f"seed {SEED}: a zero input"
