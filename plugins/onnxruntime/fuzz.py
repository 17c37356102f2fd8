"""Fuzz infmoe::ContinuousSliceFFN through onnxruntime, meant for the AddressSanitizer build.

Random shapes (zero-size and prefill-size token counts included), dtypes, thread counts and
windows; about a third of the cases are invalid (starts out of range, a mismatched or missing
dimension, slice_width > H). A valid case must match the PyTorch reference, an invalid one must
raise an onnxruntime error; anything else, or any sanitizer report, is a finding.

    plugins/onnxruntime/build.sh --asan
    LD_PRELOAD="$(c++ -print-file-name=libasan.so) $(c++ -print-file-name=libstdc++.so)" \\
      ASAN_OPTIONS=detect_leaks=0 INFMOE_ORT_LIBRARY=plugins/onnxruntime/build-asan/libinfmoe_ort.so \\
      .venv/bin/python plugins/onnxruntime/fuzz.py --cases 10000

(docs/onnxruntime-kernel.md says why libstdc++ is preloaded too.)
"""

import argparse
import sys

import numpy as np
import onnxruntime as ort
import torch

from infmoe_export.model import continuous_slice_ffn
from infmoe_export.export.function import op_model
from infmoe_export.runtimes import ort_kernel

NAMES = ("X", "starts", "w_in", "b_in", "w_out", "b_out")
SLICE_WIDTHS = (1, 2, 3, 5, 8, 13, 31, 64, 100, 257)


def problem_of(feeds, r):
    """Why the op must refuse these inputs (SPEC §4), or None when they are valid."""
    x, starts, w_in = feeds["X"].shape, feeds["starts"].shape, feeds["w_in"].shape
    if not x or len(starts) != len(x) or starts[:-1] != x[:-1] or starts[-1] < 1:
        return "shape"
    h = w_in[0] if len(w_in) == 2 else -1
    if w_in != (h, x[-1]) or feeds["b_in"].shape != (h,) or feeds["w_out"].shape != w_in or feeds["b_out"].shape != x[-1:]:
        return "shape"
    if r > h:
        return "slice_width"
    if feeds["starts"].size and (feeds["starts"].min() < 0 or feeds["starts"].max() > h - r):
        return "start"
    return None


def random_case(rng):
    lead = tuple(int(n) for n in rng.integers(0, 5, size=rng.integers(0, 3)))
    if rng.random() < 0.1:
        lead = (int(rng.integers(100, 300)),)  # the prefill path, several groups
    # A few slice widths, so that sessions (one per width) are reused; sometimes r = H.
    r = int(rng.choice(SLICE_WIDTHS))
    d, h = int(rng.integers(1, 80)), r if rng.random() < 0.15 else r + int(rng.integers(0, 200))
    k = int(rng.integers(1, 10))
    dtype = np.float16 if rng.random() < 0.2 else np.float32
    feeds = {
        "X": rng.standard_normal(lead + (d,)),
        "starts": rng.integers(0, h - r + 1, size=lead + (k,)),
        "w_in": rng.standard_normal((h, d)) / np.sqrt(d),
        "b_in": rng.standard_normal(h),
        "w_out": rng.standard_normal((h, d)) / np.sqrt(h),
        "b_out": rng.standard_normal(d),
    }
    feeds = {n: v.astype(np.int64 if n == "starts" else dtype) for n, v in feeds.items()}
    roll = rng.random()
    if roll < 0.12 and feeds["starts"].size:
        bad = rng.choice([-1, h - r + 1, int(rng.integers(-2 ** 62, 2 ** 62))])
        feeds["starts"].reshape(-1)[rng.integers(feeds["starts"].size)] = bad
    elif roll < 0.30:  # one input gets a dimension changed, dropped or added
        name = NAMES[rng.integers(len(NAMES))]
        shape = list(feeds[name].shape)
        if shape and rng.random() < 0.7:
            axis = int(rng.integers(len(shape)))
            shape[axis] = max(0, shape[axis] + int(rng.choice([-1, 1, 2])))
        elif shape and rng.random() < 0.5:
            shape = shape[:-1]
        else:
            shape = shape + [1]
        feeds[name] = np.zeros(shape, np.int64) if name == "starts" else rng.standard_normal(shape).astype(dtype)
    elif roll < 0.33:
        r = h + int(rng.integers(1, 4))
    return feeds, r, dtype, problem_of(feeds, r)


def main():
    parser = argparse.ArgumentParser(description="Fuzz the ContinuousSliceFFN kernel.")
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"fuzz: library {ort_kernel.custom_op_library()}")

    sessions = {}

    def session(r, dtype, threads):
        key = (r, dtype, threads)
        if key not in sessions:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.log_severity_level = 4  # the refused cases would each log an error line
            if not ort_kernel.register(options):
                sys.exit("fuzz: the kernel library is not built")
            model = op_model(r, "float16" if dtype == np.float16 else "float32")
            sessions[key] = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return sessions[key]

    rng = np.random.default_rng(args.seed)
    findings, counts = [], {"valid": 0, "start": 0, "shape": 0, "slice_width": 0}
    for case in range(args.cases):
        feeds, r, dtype, problem = random_case(rng)
        threads = int(rng.integers(1, 3))
        try:
            y = session(r, dtype, threads).run(None, feeds)[0]
            error = None
        except Exception as exc:  # onnxruntime's error types
            y, error = None, str(exc).splitlines()[0]
        counts[problem or "valid"] += 1
        if problem is not None:
            if error is None:
                findings.append(f"case {case}: invalid ({problem}) but no error")
            continue
        if error is not None:
            findings.append(f"case {case}: valid but raised: {error}")
            continue
        tensors = [torch.from_numpy(feeds[n]).float() if n != "starts" else torch.from_numpy(feeds[n]) for n in NAMES]
        ref = continuous_slice_ffn(*tensors, r).numpy()
        scale = max(float(np.abs(ref).max()), 1.0) if ref.size else 1.0
        tolerance = 2e-3 if dtype == np.float16 else 1e-5
        if y.shape != ref.shape or (ref.size and np.abs(y.astype(np.float64) - ref).max() > tolerance * scale):
            findings.append(f"case {case}: wrong result (shape {y.shape} vs {ref.shape})")
    print(f"fuzz: {args.cases} cases ({counts}), {len(sessions)} sessions, {len(findings)} findings")
    for line in findings[:20]:
        print("  " + line)
    sys.exit(1 if findings else 0)


if __name__ == "__main__":
    main()
